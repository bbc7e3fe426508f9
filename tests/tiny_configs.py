"""Framework-free parts of the tiny test pipelines: configs, and a CLIP BPE vocabulary written to disk
so tokenizers load with no model hub."""
import json
import os


def write_clip_vocab(folder: str) -> tuple:
    """A byte-level BPE vocabulary with no merges: every character is a token."""
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(161, 256)]
    chars += [chr(256 + i) for i in range(256 - len(chars))]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    vocab_file, merges_file = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(vocab_file, "w") as f:
        json.dump(vocab, f)
    with open(merges_file, "w") as f:
        f.write("#version: 0.2\n")
    return vocab_file, merges_file, len(vocab)


# CLIPTextConfig arguments (plus vocab_size from write_clip_vocab), the same in transformers and ppdiffusers.
CLIP_TEXT = dict(
    hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
    max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
)
# AutoencoderKL arguments.
VAE = dict(
    block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8, sample_size=32,
)
