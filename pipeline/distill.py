"""Self-distillation data for draft-head training: `python -m jobs.distill_data [key=value ...]`.

A draft head is only as good as its match with what the target actually writes. ShareGPT replies
were written by other models; the target's own continuations of the same prompts are what it
will be asked to predict at inference (a base model in particular loops and rephrases in ways
no human reply does). This job takes the first user turn of training-split conversations, has the
pipeline itself (`pipeline.run`) write the target's replies, and turns prompt + reply into
ShareGPT-style JSONL that `jobs.train_draft` reads as `data.source`. Decoding is lossless, so the
replies are the target's whatever the mode: by default the pipeline config's own (the fastest
setting, `dart_lookup` in configs/local.yaml) with its stop strings (a new "User:" turn ends the
reply, so the data is not full of the base model's invented dialogue):

    python -m jobs.distill_data num_prompts=2000 output=outputs/distill/sharegpt_self.jsonl
    python -m jobs.train_draft configs/train_default_head.yaml data.source=outputs/distill/sharegpt_self.jsonl

Prompts come from the training split only, so benchmark prompts (dev split) never leak in. The
generation step resumes: stop it at any point, run the same command again and only missing rows
are generated; `convert_only=true` writes the JSONL from whatever has been generated so far.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from dart_train.corpus import first_user_prompts, write_prompts_jsonl
from pipeline.data.outputs import read_output
from pipeline.run import run_pipeline
from pipeline.settings.config import load_config


@dataclass
class DistillConfig:
    num_prompts: int = 2000
    max_prompt_chars: int = 1500  # longer first turns are skipped, not cut
    source: str = "default"  # conversations to take prompts from (their train split)
    pipeline_config: str = "configs/local.yaml"  # model and resources; mode/inputs/outputs set here
    overrides: list[str] = field(default_factory=list)  # extra pipeline dotlist, e.g. resources.num_workers=4
    mode: str | None = None  # decoding.mode; None: the pipeline config's (configs/local.yaml: dart_lookup)
    temperature: float = 0.0  # 0: the greedy replies the head will be asked to predict
    max_new_tokens: int = 128
    batch_size: int = 16  # rows handed to the worker at a time (resources.max_live of them decode together)
    work_dir: str = "outputs/distill/work"  # prompts and the pipeline's Parquet output (resumable)
    output: str = "outputs/distill/sharegpt_self.jsonl"
    # Also an N-gram trie over the written conversations (jobs.build_ngram, the target's
    # tokenizer): the DART beam search's corpus term drafts much better from the target's own
    # replies than from ShareGPT (docs/ngram.md); use it as model.trie. None: no trie.
    trie_output: str | None = None
    trie_order: int = 4
    convert_only: bool = False


def write_prompts(cfg: DistillConfig, path: Path) -> int:
    prompts = first_user_prompts(cfg.num_prompts, split="train", source=cfg.source, max_chars=cfg.max_prompt_chars)
    return write_prompts_jsonl(prompts, path)


def generate(cfg: DistillConfig, prompts_path: Path, output_url: str) -> dict:
    pcfg = load_config(cfg.pipeline_config, [
        f"input.urls=[{prompts_path}]", "input.format=jsonl", "input.id_column=id", "input.prompt_column=prompt",
        *([f"decoding.mode={cfg.mode}"] if cfg.mode else []), f"decoding.temperature={cfg.temperature}",
        f"decoding.max_new_tokens={cfg.max_new_tokens}", f"resources.batch_size={cfg.batch_size}",
        f"output.url={output_url}", "run.run_id=distill", "run.resume=true", *cfg.overrides,
    ])
    return run_pipeline(pcfg)


def reply_text(text: str) -> str:
    """The reply as train_draft expects it: it re-adds the one space a base-model frame puts
    between "Assistant:" and the reply, so that space is taken off here."""
    return text[1:] if text.startswith(" ") else text


def write_conversations(prompts_path: Path, output_url: str, out_path: Path) -> dict[str, int]:
    """Join generated rows with their prompts into ShareGPT-style JSONL; failed rows are left out."""
    prompts = {}
    for line in prompts_path.read_text().splitlines():
        row = json.loads(line)
        prompts[row["id"]] = row["prompt"]
    table = read_output(output_url, columns=["id", "text", "error", "finish_reason"])
    counts = {"generated": table.num_rows, "written": 0, "errors": 0, "empty": 0}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with tmp.open("w") as f:
        for row in table.to_pylist():
            if row["error"] is not None or row["id"] not in prompts:
                counts["errors"] += 1
                continue
            reply = reply_text(row["text"] or "")
            if not reply.strip():
                counts["empty"] += 1
                continue
            f.write(json.dumps({"id": f"self-{row['id']}", "finish_reason": row["finish_reason"], "conversations": [
                {"from": "human", "value": prompts[row["id"]]}, {"from": "gpt", "value": reply}]}) + "\n")
            counts["written"] += 1
    tmp.replace(out_path)
    return counts


def main(argv: list[str] | None = None) -> int:
    cfg: DistillConfig = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(DistillConfig), OmegaConf.from_cli(argv)))
    work = Path(cfg.work_dir)
    prompts_path = work / "prompts.jsonl"
    output_url = str(work / "generated")
    if not cfg.convert_only:
        n = write_prompts(cfg, prompts_path)
        print(f"{n} training-split prompts -> {prompts_path}", flush=True)
        summary = generate(cfg, prompts_path, output_url)
        print(f"generated: {json.dumps(summary.get('this_run', {}))[:400]}", flush=True)
    counts = write_conversations(prompts_path, output_url, Path(cfg.output))
    print(f"wrote {counts['written']} conversations to {cfg.output} ({json.dumps(counts)})", flush=True)
    if cfg.trie_output:
        build_trie(cfg)
    return 0


def build_trie(cfg: DistillConfig) -> dict:
    """The trie over every written conversation (prompt and reply), with the pipeline's target's
    tokenizer, so that the pipeline accepts it as model.trie (its fingerprint is checked there)."""
    from dart_train.ngram_build import BuildNgramConfig, build_ngram

    target = load_config(cfg.pipeline_config, list(cfg.overrides)).model.target
    sidecar = build_ngram(BuildNgramConfig(input=cfg.output, output=cfg.trie_output, tokenizer=target, split="all",
                                           order=cfg.trie_order, progress=False))
    counts = sidecar["counts"]
    print(f"wrote the trie {cfg.trie_output} ({counts['documents']} documents, {counts['tokens']} tokens, "
          f"order {cfg.trie_order})", flush=True)
    return sidecar
