"""The web UIs' front-end: their own token merging answered by this project (the extension, scripts/tomesd_webui.py).
a1111.py: AUTOMATIC1111's `sd_models.tomesd`, with the extension's choices; forge.py: Forge's
`backend.misc.tomesd.TomePatcher` on its UNet patchers."""
