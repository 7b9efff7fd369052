"""The data and checkpoint commands: ``prepare-data`` (token rows from the stdlib or from text, with
a given or trained tokenizer) and ``export`` (a run's weights or checkpoint as a Hugging Face
folder or a torch distributed checkpoint)."""

from __future__ import annotations

import sys

from ..config import TrainerConfig
from ..errors import ConfigError
from ..storage.uris import mask


def _cmd_prepare(args) -> int:
    from ..errors import DataError

    if args.job is not None:
        return _prepare_job(args)
    if args.out is None:
        raise DataError("prepare-data needs --out DIR (or --job JOB.yaml, whose data.path it prepares)")
    if args.tokenizer is None and args.train_tokenizer is None:
        if args.input is not None:
            raise DataError(f"--input({args.input!r}) is tokenized with --tokenizer or --train-tokenizer; neither "
                            "was given (without them, prepare-data writes the stdlib byte corpus)")
        from ..data.corpus import prepare_stdlib_corpus

        rows = prepare_stdlib_corpus(args.out, args.seq_len, int(args.max_mb * (1 << 20)))
        print(f"wrote {rows} rows of {args.seq_len + 1} byte tokens to {args.out}")
        return 0
    if args.input is None:
        raise DataError("prepare-data with --tokenizer or --train-tokenizer needs --input PATH: the Parquet, .txt "
                        "or .jsonl text to tokenize, or 'stdlib' (the Python standard library's source)")
    from ..data.prepare import prepare_tokenized

    res = prepare_tokenized(args.input, args.out, args.tokenizer, column=args.column, out_column=args.out_column,
                            eos=not args.no_eos, eos_token=args.eos_token, train=args.train_tokenizer,
                            vocab_size=args.vocab_size, max_bytes=int(args.max_mb * (1 << 20)))
    _print_prepared(res)
    return 0


def _prepare_job(args) -> int:
    """``--job``: the job's data.prepare recipe, written to --out or else to its data.path."""
    from ..data.prepare import prepare_recipe

    cfg = TrainerConfig.from_yaml(args.job, args.set)
    recipe = cfg.data.prepare
    if recipe is None or isinstance(recipe, str):
        raise ConfigError(f"job {args.job!r} has data.prepare({recipe!r}), not a tokenizing recipe "
                          "(data.prepare: {input: ..., train_tokenizer: bpe, vocab_size: N} or {tokenizer: ...})")
    _print_prepared(prepare_recipe(recipe, args.out or cfg.data.path, cfg.data.column))
    return 0


def _print_prepared(res: dict) -> None:
    if "note" in res:
        print(f"note: {res['note']}", file=sys.stderr)
    print(f"wrote {res['rows']} rows, {res['tokens']} tokens ({res['files']} files) to {mask(str(res['path']))}")
    print(f"tokenizer: {res['tokenizer']}, {res['vocab_size']} tokens (saved there as _tokenizer.json; ids up to "
          f"{res['max_token_id']}: the model's vocab_size must be at least {res['max_token_id'] + 1})")


def _cmd_export(args) -> int:
    if args.hf and args.out and args.hf != args.out:
        raise ConfigError(f"export: two folders given, OUT {args.out!r} and --hf {args.hf!r}; give one")
    out, fmt = args.out or args.hf, args.format or ("hf" if args.hf else None)
    if args.hf and fmt != "hf":
        raise ConfigError(f"export: --hf OUT writes a Hugging Face folder, not --format {fmt}; give OUT alone")
    if out is None:
        raise ConfigError("export: give the folder to write (elastic-trainer export SOURCE OUT [--format hf|dcp])")
    if fmt == "dcp":
        from ..checkpoint.dcp_export import export_dcp

        out = export_dcp(args.source, out)
        print(f"wrote a torch distributed checkpoint to {mask(out)} (torch.distributed.checkpoint.load reads it; "
              "model.init_from starts a run from it)")
        return 0
    from ..checkpoint.hf_export import export

    out = export(args.source, out)
    print(f"wrote a Hugging Face folder to {mask(out)} (AutoModelForCausalLM.from_pretrained loads it)")
    return 0


def add_parsers(sub) -> None:
    """Add ``prepare-data`` and ``export`` to the command line's subparsers."""
    p = sub.add_parser("prepare-data", help="Write Parquet token rows: the Python-stdlib byte corpus, or "
                                            "text tokenized with a given or trained tokenizer.",
                       description="Write the Python-stdlib byte corpus as Parquet token rows; with --input PATH "
                                   "and --tokenizer or --train-tokenizer, tokenize that text instead (one "
                                   "list<int32> row per document, ending with the tokenizer's EOS; the tokenizer "
                                   "saved beside the rows as _tokenizer.json, a summary with its vocabulary as "
                                   "_prepared.json). --job prepares a job's data.prepare recipe.")
    p.add_argument("--out", help="output directory (must not exist yet when tokenizing; default with --job: "
                                 "the job's data.path)")
    p.add_argument("--job", metavar="JOB.yaml", help="prepare as this job's data.prepare recipe says")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="with --job: override a config value (repeatable)")
    p.add_argument("--seq-len", type=int, default=128, help="stdlib corpus: tokens per training sequence "
                                                             "(rows hold seq_len + 1)")
    p.add_argument("--max-mb", type=float, default=8.0, help="input stdlib: size cap in MiB (default 8)")
    p.add_argument("--tokenizer", metavar="FILE|DIR|NAME",
                   help="a tokenizer.json, a folder holding one (a Hugging Face model folder), or a hub name "
                        "such as gpt2 (needs the hub reachable, or its cache)")
    p.add_argument("--train-tokenizer", type=str.lower, choices=["bpe", "unigram"],
                   help="train a tokenizer of this kind on --input first (no download): byte-level BPE or Unigram")
    p.add_argument("--vocab-size", type=int, metavar="N", help="with --train-tokenizer: its vocabulary size "
                                                              "(the model's vocab_size)")
    p.add_argument("--input", metavar="PATH", help="the text: Parquet file or directory (local or a pyarrow URI), "
                                                   ".txt (a document per line), .jsonl, or 'stdlib' (the Python "
                                                   "standard library's source, a document per file)")
    p.add_argument("--column", default="text", help="the text column (Parquet) or key (.jsonl); default text")
    p.add_argument("--out-column", default="tokens", help="the token column written; default tokens")
    p.add_argument("--no-eos", action="store_true", help="do not end each row with the EOS token")
    p.add_argument("--eos-token", metavar="TOKEN", help="the EOS token (default: the first of </s>, "
                                                        "<|endoftext|>, <eos>, ... in the vocabulary)")
    p.set_defaults(fn=_cmd_prepare)
    ex = sub.add_parser("export", help="Write a run's weights as a Hugging Face folder (model.kind hf), or its "
                                       "weights and optimizer state as a torch distributed checkpoint.",
                        description="--format hf (the default): config.json and model.safetensors that "
                                    "AutoModelForCausalLM.from_pretrained loads. --format dcp: a torch distributed "
                                    "checkpoint (torchtitan's layout: parameters by global name, AdamW state under "
                                    "optimizer.*), one file per part of the source. SOURCE: a run's "
                                    "model.safetensors (or its output folder, or a failed run's "
                                    "model-step-N.safetensors) or a durable checkpoint directory (step-N-<run id>; "
                                    "the only source with optimizer state).")
    ex.add_argument("source", help="weights file, run output folder, or durable checkpoint directory")
    ex.add_argument("out", nargs="?", metavar="OUT", help="the folder to write")
    ex.add_argument("--format", choices=("hf", "dcp"), help="hf (default) or dcp (a local folder)")
    ex.add_argument("--hf", metavar="OUT", help="the folder to write, as a Hugging Face folder (as OUT with "
                                                "--format hf)")
    ex.set_defaults(fn=_cmd_export)
