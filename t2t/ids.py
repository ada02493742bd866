"""The reserved token ids, defined once: the tokenizer, the model, decoding and the data use these.

PAD (0) pads rows and is the decoder's start token (targets are shifted right with it); EOS (1) ends
every sentence; UNK (2) is SentencePiece's unknown piece (byte fallback makes it rare). There is no
BOS. Importing this module imports nothing else.
"""

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2


def content(ids) -> list[int]:
    """The ids a tokenizer turns into text: those before the first EOS, PAD left out."""
    kept = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i != PAD_ID:
            kept.append(i)
    return kept
