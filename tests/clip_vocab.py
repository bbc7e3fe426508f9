"""A tiny CLIP BPE vocabulary written to disk, so tokenizers load with no model hub."""
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
