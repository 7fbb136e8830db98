"""`jobs.bench job_ngram`: earlier outputs are read from both job formats, configs fail clearly, and
the job runs end to end on a tiny model (the job n-gram warmed, the 'off' cell without one)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dart_bench.job_ngram import parse_config
from dart_bench.replay import TuneConfigError
from dart_train.corpus import job_output_documents
from jobs.bench import main as bench_main


class WordTokenizer:
    """Token id = word length."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[len(w) for w in text.split()] for text in texts]}


def test_earlier_outputs_come_from_distill_jsonl_pipeline_jsonl_and_parquet(tmp_path):
    distill = tmp_path / "distill.jsonl"
    distill.write_text("\n".join(json.dumps(r) for r in [
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a bb ccc"}]},
        {"conversations": [{"from": "human", "value": "no reply"}]},  # skipped
        {"completion": "dddd"},
        {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"},
                           {"from": "gpt", "value": "last reply wins"}]},
    ]) + "\n")
    assert job_output_documents(str(distill), 10, WordTokenizer()) == [[1, 2, 3], [4], [4, 5, 4]]
    assert job_output_documents(str(distill), 2, WordTokenizer()) == [[1, 2, 3], [4]]
    parquet = tmp_path / "out.parquet"
    pq.write_table(pa.table({"completion": ["ab c", None, "", "dddd ee"]}), parquet)
    assert job_output_documents(str(parquet), 10, WordTokenizer()) == [[2, 1], [4, 2]]


@pytest.mark.parametrize("args, message", [
    (["mode=ddtree"], "the job n-gram drafts in dart and dart_lookup only"),
    (["earlier_outputs=/no/such/file.jsonl"], "is not a file"),
    (["warm_rows=[]"], "warm_rows and priors"),
    (["priors=[-1.0]"], "warm_rows and priors"),
    (["base={job_ngram_order: 9}"], "job_ngram_order: must be <= 6"),
    (["no_such_key=1"], "no_such_key"),
])
def test_bad_configs_are_clear_errors(args, message, tmp_path):
    outputs = tmp_path / "o.jsonl"
    outputs.write_text('{"completion": "a"}\n')
    with pytest.raises(TuneConfigError, match=message):
        parse_config([f"earlier_outputs={outputs}", *args])


def test_end_to_end_on_a_tiny_model(tmp_path):
    from tests.tiny_models import save_tiny_artifacts

    art = save_tiny_artifacts(tmp_path / "art")
    outputs = tmp_path / "earlier.jsonl"
    outputs.write_text("\n".join(json.dumps({"completion": f"the answer is {i} and then {i} again"})
                                 for i in range(12)) + "\n")
    args = [f"target={art['target']}", f"head={art['head']}", f"trie={art['trie']}", "dtype=fp32", "threads=1",
            f"earlier_outputs={outputs}", "num_prompts=3", "check_prompts=1", "max_new_tokens=8",
            "budgets=[8]", "warm_rows=[0,10]", "priors=[1.0,4.0]", f"output_dir={tmp_path / 'out'}"]
    assert bench_main(["job_ngram", *args]) == 0
    figures = json.loads((tmp_path / "out" / "job_ngram.json").read_text())
    rows = figures["results"]
    assert [(r["job_ngram"], r["warm_rows"], r["prior"]) for r in rows] == \
        [("off", 0, None), ("on", 0, 1.0), ("on", 10, 1.0), ("on", 0, 4.0), ("on", 10, 4.0)]
    off, warm = rows[0], rows[2]
    assert off["warm_tokens"] == 0 and off["memory_bytes"] == 0
    assert warm["warm_tokens"] > rows[1]["warm_tokens"] > 0  # the 3 prompts' replies, then + 10 outputs
    assert all(r["tau"] >= 1.0 and len(r["per_prompt_tau"]) == 3 for r in rows)
    assert "| 8 | on | 10 | 4 |" in (tmp_path / "out" / "job_ngram.md").read_text()
