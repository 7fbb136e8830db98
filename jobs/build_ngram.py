"""Build an N-gram trie from a corpus: `python -m jobs.build_ngram [key=value ...]`.

    python -m jobs.build_ngram output=/data/sharegpt-3gram.trie            # default corpus + tokenizer
    python -m jobs.build_ngram input='s3://bucket/chats/*.jsonl' tokenizer=/models/llama output=s3://bucket/llama.trie
    python -m jobs.build_ngram --config configs/build_ngram_sharegpt.yaml order=4 min_count=2

Reads conversations from any fsspec URL (or the packaged ShareGPT train split), tokenizes them
with the target's Hugging Face tokenizer and counts them into a trie file with bounded memory;
writes `<output>.json` beside it, a sidecar recording what was built from what. The build
itself is `dart_train.ngram_build` (also used for the embedded default trie); this module is
its command line.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from omegaconf import OmegaConf

from dart_train.ngram_build import BuildNgramConfig, build_ngram


def parse_config(argv: list[str] | None = None) -> BuildNgramConfig:
    """Defaults < ``--config`` YAML < ``key=value`` overrides, checked against BuildNgramConfig."""
    defaults = OmegaConf.to_yaml(OmegaConf.structured(BuildNgramConfig))
    parser = argparse.ArgumentParser(
        prog="python -m jobs.build_ngram",
        description=__doc__,
        epilog="config keys and defaults:\n" + textwrap.indent(defaults, "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="YAML config file (keys of BuildNgramConfig)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. order=4 limit=1000")
    args = parser.parse_args(argv)
    schema = OmegaConf.structured(BuildNgramConfig)
    layers = [schema]
    if args.config:
        layers.append(OmegaConf.load(args.config))
    layers.append(OmegaConf.from_dotlist(args.overrides))
    merged = OmegaConf.merge(*layers)  # unknown keys and wrong types raise, naming the key
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def _print_summary(sidecar: dict[str, Any], output: str) -> None:
    c, t = sidecar["counts"], sidecar["timing"]
    skipped = sidecar["corpus"]["skipped"]
    print(f"wrote {output} ({sidecar['trie_bytes'] / 1e6:.1f} MB) and {output}.json")
    print(
        f"  {c['documents']} documents, {c['tokens']} tokens, nodes per level {c['nodes_per_level'][1:]}"
        f" ({c['bytes_per_node']:.1f} B/node)"
    )
    print(
        f"  {t['total_s']:.1f} s total: read+tokenize {t['read_and_tokenize_s']:.1f} s "
        f"({t['tokenize_tokens_per_s'] / 1e6:.2f} M tok/s), count {t['count_s'] + t['finish_s']:.1f} s "
        f"({t['count_tokens_per_s'] / 1e6:.2f} M tok/s)"
    )
    print(f"  skipped records: {skipped or 'none'}")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    sidecar = build_ngram(cfg)
    _print_summary(sidecar, str(cfg.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
