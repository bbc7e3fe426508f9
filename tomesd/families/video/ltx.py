"""LTX-Video (0.9.x) and LTX-2 on diffusers: a packed latent [B, N, C] whose grid is its num_frames, height and width
arguments (layout "packed"); LTX-2's audio stream never merges. ComfyUI's LTX-Video: Wan's space-time grid, the patch
read from the root's patchifier, guide frames passing whole (layout "comfy_ltxv", ComfyLTXV here).

The block kind of LTX-2 (diffusers' LTX2VideoTransformer3DModel): each block runs a video stream and an audio stream
side by side, and two cross-modal attentions between them. Only the video stream's own sub-layers merge; the audio's
are never hooked, so they see every audio token, and the audio's view of the video is every video token. 
A block, in order (diffusers 0.42, transformer_ltx2.py), with what ToMe does at each sub-layer:
  attn1                video self-attention, queries and keys rotated by the video's rows: merges (merge_attn),
                       its rows follow the merged tokens
  audio_attn1          audio self-attention: never hooked
  attn2                video queries over the text: merges (merge_crossattn)
  audio_attn2          audio queries over the text: never hooked
  audio_to_video_attn  "a2v": video queries (rotated by the video's time rows) over the audio's keys and values, its
                       output added to the video stream: merges (merge_crossattn) as a cross-attention to the text
                       does; its query rows follow the merged tokens, the audio's key rows stay
  video_to_audio_attn  "v2a": audio queries over the video's keys and values, its output added to the audio stream:
                       never hooked. Its keys and values are projected from the block's own video stream, which ToMe
                       never merges (it merges sub-layers' inputs, not the residual stream), so the audio attends over
                       every video token. Merging them would change what the audio stream computes (a softmax over
                       fewer keys), which ToMe must not do: the audio is not the image it approximates.
  ff                   video feed-forward: merges (merge_mlp)
  audio_ff             audio feed-forward: never hooked
The AdaLN modulations and gates (per token where the pipeline gives a timestep per token) are applied to the block's
own tensors around these sub-layers, on every token, never inside them, as in LTX-Video's blocks.

The "comfy_ltxv" layout: ComfyUI's LTX-Video (comfy.ldm.lightricks.model.LTXVModel). Its latent [B, C, F, H, W] is
patchified inside by a SymmetricPatchifier whose patch (1, 1, 1) the root names nowhere else (no patch_size
attribute or config), so the patch is read from the patchifier; tokens are in (frame, row, col) order, Wan's
space-time grid. Guide frames (LTXVAddGuide: keyframes, or a video to extend) are appended to the latent along its
frames, their tokens last, with their own coordinates in `keyframe_idxs` [B, 3, guide tokens]: they are condition
tokens and pass whole (call.tail, TokenMerge.with_passing_tail); the target's frames before them merge. Only shapes
are read."""
from __future__ import annotations

from numbers import Integral
from typing import Any, Optional, Tuple

from ...layouts.coordinates import SpaceTime
from ...layouts.entries import BlockKind, Downsample, RootKind, Sublayer
from ...layouts.signatures import InputSpec


# LTX-2's rows (cos, sin) have a batch axis and put the tokens second to last: [B, S, D] (rope_type "interleaved",
# the default) or [B, heads, S, D / 2] ("split", LTX-2's released checkpoints). Either way, axis -2.
_ROWS = -2
LTXV_MODULE = "comfy.ldm.lightricks."


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # LTX-Video: self-attention over every frame's tokens, its queries and keys rotated by rows (cos, sin) [B, S, D]
    # (a batch axis: they follow each sample); cross-attention to the text (given the tokens by position); the
    # feed-forward. The AdaLN modulations (per token where LTX 0.9.5+'s pipelines give a timestep per token) and
    # gates are applied to the block's own tensors around these sub-layers, on every token, never inside them.
    BlockKind(
        "LTXVideoTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            rotary_axis=1),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
    ),
    BlockKind(
        "LTX2VideoTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="query_rotary_emb",
                            rotary_axis=_ROWS),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("audio_to_video_attn", "merge_crossattn", tokens=("hidden_states",),
                            rotary="query_rotary_emb", rotary_axis=_ROWS),
                   Sublayer("ff", "merge_mlp", tokens=("hidden_states",))),
        # Its processor rotates queries and keys, then calls diffusers' dispatch: the video's keys shrink there.
        downsample=(Downsample("attn1", "dispatch"),),
        tokens=("hidden_states",),  # the video stream (audio_hidden_states is the block's second input)
        module="diffusers.",
    ),
    # LTX-Video's BasicTransformerBlock(x, context, attention_mask, timestep, pe): self-attention `attn1` given the
    # modulated tokens and the rotary rows `pe` [B, 1, N, D/2, 2, 2] by keyword (they follow each sample's merged
    # tokens), the text cross-attention `attn2` (its mask addresses the text keys only) and `ff`. Its modulation,
    # per sample or per token (a timestep per token: image-to-video), is applied outside these sub-layers. Unlike
    # the UNets' block of this name, attn1's keys are rotated by rows for every token inside it: no ToDo.
    BlockKind(
        "BasicTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("x",), rotary="pe", rotary_axis=2),
                   Sublayer("attn2", "merge_crossattn", tokens=("x",)),
                   Sublayer("ff", "merge_mlp", tokens=("x",))),
        downsample=(),
        tokens=("x",),
        no_downsample=(
            "LTX-Video here (ComfyUI's LTXVModel) rotates self-attention's keys by rows for every token inside its "
            "attention module, so keys from a downsampled grid would not meet their rows; use mode='merge'"),
        module=LTXV_MODULE,
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # LTX-Video (0.9.x): a packed latent [B, N, C] in (frame, row, col) order whose grid is its num_frames, height
    # and width arguments (in tokens). LTXConditionPipeline passes video_coords instead, with condition tokens
    # joined to the sequence: refused at its first call (layouts/packed.py).
    RootKind("LTX-Video", ("LTXVideoTransformer3DModel",), "packed", grid_args=("num_frames", "height", "width"),
             supported="the LTX-Video transformer (torch; called with num_frames, height and width)"),
    # LTX-2: LTX-Video's packed video latent and grid arguments, beside an audio latent of its own. Only the video
    # stream's sub-layers merge (its block kind, above); the audio's tokens, and the video tokens the audio attends to,
    # stay.
    RootKind("LTX-2", ("LTX2VideoTransformer3DModel",), "packed", grid_args=("num_frames", "height", "width"),
             supported="the LTX-2 audio-video transformer (torch; called with num_frames, height and width; its audio "
                       "stream never merges)"),
    # ComfyUI's LTX-Video: Wan's space-time grid, the patch from its patchifier; guide frames pass whole
    # (ComfyLTXV, below).
    RootKind("LTX-Video (ComfyUI)", ("LTXVModel",), "comfy_ltxv", frame_axis=2, module="comfy.",
             supported="ComfyUI's LTX-Video (comfy.ldm.lightricks.model.LTXVModel; merge mode; its guide frames "
                       "never merge)"),
)


def _patchifier_patch(root: Any) -> Optional[Tuple[int, int, int]]:
    size = getattr(getattr(root, "patchifier", None), "patch_size", None)
    if isinstance(size, (tuple, list)) and len(size) == 3 and all(isinstance(p, Integral) and p > 0 for p in size):
        return tuple(int(p) for p in size)
    return None


class ComfyLTXV(SpaceTime):
    """SpaceTime's grid and matching, the patch from the root's patchifier; guide frames' tokens pass whole."""

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        self.found_patch = _patchifier_patch(root)
        super().__init__(root, kind, xp, kind.frame_axis or 2, self.found_patch or (1, 1, 1))
        self.guides = InputSpec.find(root, ("keyframe_idxs",), False)

    def validate(self, patch: Any) -> None:
        if self.found_patch is None:
            raise ValueError(f"ToMe reads {self.model}'s patch size from its patchifier's patch_size, (frames, rows, "
                             f"cols) ints, and this model has none: apply it to the LTXVModel ComfyUI builds")

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        super().read(call, module, args, kwargs, shape, name)
        guides = None if self.guides is None else self.guides.get(args, kwargs)
        if guides is None:
            return
        f, h, w = call.grid
        given = self.xp.shape(guides)
        tokens = given[-1] if len(given) == 3 else -1
        if tokens < 0 or tokens % (h * w) or tokens >= f * h * w:
            raise ValueError(f"{self.model} was given keyframe_idxs of shape {list(given)} for a latent of {f} frames "
                             f"of {h}x{w} tokens: ToMe passes guide frames' tokens whole, as whole frames after the "
                             f"target's, and these are not; bypass the ToMe node for this model")
        call.grid = (f - tokens // (h * w), h, w)  # the target's frames; the guides' tokens follow them
        call.tail = tokens


LAYOUTS = {"comfy_ltxv": ComfyLTXV}
