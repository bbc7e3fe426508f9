"""diffusers 0.42's later families that ToMe does not merge yet are refused at apply time by name."""
import pytest
import torch

import tomesd

REFUSED = ["JoyImageEditPlusTransformer3DModel", "BriaFibo2Transformer2DModel", "WanAnimate2Transformer3DModel",
           "Ideogram4Transformer2DModel", "MotifVideoTransformer3DModel", "NucleusMoEImageTransformer2DModel",
           "DreamLiteTransformer2DModel", "DreamLiteUNetModel", "Kandinsky5Transformer3DModel",
           "Kandinsky6Transformer3DModel", "Kandinsky6SRTransformer3DModel", "HeliosTransformer3DModel",
           "AnyFlowTransformer3DModel", "AnyFlowFARTransformer3DModel", "ErnieImageTransformer2DModel",
           "AllegroTransformer3DModel", "MiniMaxH3Transformer3DModel", "SanaWMTransformer3DModel",
           "SanaWMLTX2RefinerTransformer3DModel"]


@pytest.mark.parametrize("name", REFUSED)
def test_layouts_not_merged_yet_are_refused_by_name_at_apply_time(name):
    """Each is refused before anything changes, naming its class, the cause and what to do (roots_d042.py); without
    its entry, apply_patch said only that it found no transformer block ToMe knows."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None:
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")
    model = type("Unbuilt", (cls,), {"__init__": lambda self: torch.nn.Module.__init__(self)})()
    with pytest.raises(TypeError, match=f"cannot patch {name}: .*not merge yet.*without ToMe"):
        tomesd.apply_patch(model, ratio=0.5)
    assert not model._forward_pre_hooks
