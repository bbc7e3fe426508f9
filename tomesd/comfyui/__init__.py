"""A ComfyUI node pack: link this folder into ComfyUI's custom_nodes (README, "ComfyUI").

ComfyUI imports custom node folders under names of its own, so this file imports by absolute name."""
from tomesd.comfyui.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
