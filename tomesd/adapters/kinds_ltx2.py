"""The block kind of LTX-2 (diffusers' LTX2VideoTransformer3DModel): each block runs a video stream and an audio stream
side by side, and two cross-modal attentions between them. Only the video stream's own sub-layers merge; the audio's
are never hooked, so they see every audio token, and the audio's view of the video is every video token. (Registered
with kinds.BLOCK_KINDS through kinds_video.VIDEO_KINDS.)

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
"""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Downsample, Sublayer

# LTX-2's rows (cos, sin) have a batch axis and put the tokens second to last: [B, S, D] (rope_type "interleaved",
# the default) or [B, heads, S, D / 2] ("split", LTX-2's released checkpoints). Either way, axis -2.
_ROWS = -2

LTX2_KINDS: Tuple[BlockKind, ...] = (
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
)
