"""The tokenizer a corpus is prepared with: a Hugging Face one (a ``tokenizer.json``, a folder
holding one, or a hub name where the hub is reachable), or one trained here on the corpus itself
with the ``tokenizers`` library (where nothing can be downloaded).

Prepared token rows are ``int32``: every id a tokenizer can give must fit that.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import DataError

# Trainable kinds (``--train-tokenizer``): byte-level BPE (GPT-2's scheme: any text encodes, no
# unknown token) and Unigram (SentencePiece's).
TRAINABLE = ("bpe", "unigram")
# The end-of-document token a trained tokenizer gets (GPT-2's name; prepare appends it to each row).
TRAINED_EOS = "<|endoftext|>"
INT32_MAX = (1 << 31) - 1
_BYTES = 256


def load_tokenizer(source: str | Path):
    """A ``tokenizers.Tokenizer`` from ``source``: a ``tokenizer.json`` file, a folder holding one
    (a Hugging Face model folder), or a hub name such as ``gpt2`` (fetched with ``huggingface_hub``,
    which reads its cache first; it needs the hub reachable otherwise)."""
    from tokenizers import Tokenizer

    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer folder {text!r} holds no tokenizer.json (a Hugging Face fast tokenizer's "
                            "file; save one with tokenizer.save_pretrained or Tokenizer.save)")
    elif not path.is_file():
        if _looks_like_path(text):
            raise DataError(f"tokenizer file {text!r} does not exist (give the tokenizer.json a `tokenizers` "
                            "Tokenizer was saved to, a folder holding one, or a hub name)")
        path = Path(_from_hub(text))
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        raise DataError(f"tokenizer file {str(path)!r} is not a `tokenizers` JSON file: {e}") from None


def _looks_like_path(text: str) -> bool:
    return text.endswith(".json") or text.startswith(("/", ".", "~")) or text.count("/") > 1


def _from_hub(name: str) -> str:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:   # transformers brings it; without it only local tokenizers load
        raise DataError(f"tokenizer {name!r} is neither a file nor a folder, and huggingface_hub is not "
                        "installed to fetch it from the hub") from None
    try:
        return hf_hub_download(name, "tokenizer.json")
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, no tokenizer.json: one answer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"tokenizer {name!r} is neither a file nor a folder, and its tokenizer.json could not be "
                        f"fetched from the Hugging Face hub ({first}); without the hub, give a local "
                        "tokenizer.json or train one on the corpus (--train-tokenizer bpe --vocab-size N)") from None


def train_tokenizer(kind: str, vocab_size: int, texts: Iterable[list[str]]):
    """A ``tokenizers.Tokenizer`` of ``kind`` (:data:`TRAINABLE`) trained on the batches of
    documents ``texts``, with at most ``vocab_size`` tokens, :data:`TRAINED_EOS` among them.
    Deterministic: the same texts give the same tokenizer (every node may train its own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    kind = kind.lower()
    if kind not in TRAINABLE:
        raise DataError(f"train_tokenizer({kind!r}) is not one this trains; choose one of {list(TRAINABLE)}")
    least = _BYTES + 1 if kind == "bpe" else 8
    if not least <= vocab_size <= INT32_MAX + 1:
        why = ("byte-level BPE starts from the 256 bytes and the EOS token" if kind == "bpe"
               else "the token ids are int32")
        raise DataError(f"vocab_size({vocab_size}) must be between {least} and {INT32_MAX + 1} ({why})")
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS, "<unk>"],
                                          unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(_documents(texts), trainer)
    return tok


def _documents(batches: Iterable[list[str]]) -> Iterator[str]:
    for batch in batches:
        yield from batch


def check_ids_fit(tok, source: str) -> int:
    """The tokenizer's vocabulary size (added tokens included), checked to fit ``int32`` ids."""
    size = tok.get_vocab_size(with_added_tokens=True)
    if size - 1 > INT32_MAX:
        raise DataError(f"tokenizer {source!r} has {size} tokens; prepared rows hold int32 ids "
                        f"(at most {INT32_MAX + 1} tokens)")
    return size
