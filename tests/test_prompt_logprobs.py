"""Prompt logprobs: each prompt token's log-probability under the target after the tokens before it,
and the top-k alternatives, from the prefill; the same in every mode, whatever joins the batch.

Against brute force: log_softmax of the model's own logits over the whole prompt (fp32 tiny models,
ragged prompts prefilled in groups, a long prompt projected in several chunks, n completions sharing
one prefill); off, nothing is computed and the columns are null; the pipeline writes the columns.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dart_worker.drafters import drafter_names
from dart_worker.sampling.params import SamplingParams
from dart_worker.sampling.verification import _PROMPT_CHUNK
from pipeline.data.inputs import INPUT_SCHEMA
from pipeline.settings.config import to_dict
from pipeline.worker import GenerationWorker
from tests.test_engine import VOCAB, make_engine, random_prompts
from tests.tiny_models import input_row, save_tiny_artifacts, tiny_model, tiny_worker_config


@pytest.fixture(scope="module")
def model():
    return tiny_model("gemma3", vocab_size=VOCAB)


def reference(model, prompt: list[int], k: int):
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    chosen = logp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    top = logp[:-1].topk(k, dim=-1)
    return chosen.tolist(), top.indices.tolist(), top.values.tolist()


@pytest.mark.parametrize("mode", drafter_names())
def test_prompt_logprobs_equal_the_models_own_in_every_mode(model, mode):
    prompts = [*random_prompts(4, seed=5, lengths=(2, 40)), [7], list(range(3, VOCAB)) * 5]  # one token; 3 chunks
    assert len(prompts[-1]) > 2 * _PROMPT_CHUNK
    params = [SamplingParams(temperature=0.0, max_new_tokens=3, prompt_logprobs=3 if i != 2 else 0)
              for i in range(len(prompts))]
    results = make_engine(model, mode).generate(prompts, params, max_live=3)
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        if i == 2:
            assert result.prompt_logprobs is None and result.prompt_top_logprob_ids is None
            continue
        assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
        assert result.prompt_top_logprob_ids[0] is None and result.prompt_top_logprobs[0] is None
        chosen, ids, values = reference(model, prompt, 3)
        assert np.allclose(result.prompt_logprobs[1:], chosen, atol=1e-4)
        assert result.prompt_top_logprob_ids[1:] == ids
        assert np.allclose(result.prompt_top_logprobs[1:], values, atol=1e-4)


def test_completions_of_one_prompt_share_its_prompt_logprobs(model):
    prompt = random_prompts(1, seed=9)[0]
    samples = [[SamplingParams(temperature=1.0, seed=s, max_new_tokens=4, prompt_logprobs=k)
                for s, k in ((0, 2), (1, 4))]]
    first, second = make_engine(model, "dart_lookup").generate_samples([prompt], samples)[0]
    chosen, ids, _ = reference(model, prompt, 4)
    assert np.allclose(first.prompt_logprobs[1:], chosen, atol=1e-4)
    assert first.prompt_logprobs == second.prompt_logprobs
    assert first.prompt_top_logprob_ids[1:] == [row[:2] for row in ids]
    assert second.prompt_top_logprob_ids[1:] == ids


def test_the_worker_writes_prompt_logprob_columns(tmp_path):
    artifacts = save_tiny_artifacts(tmp_path)
    cfg = tiny_worker_config(artifacts)
    cfg.decoding.max_new_tokens, cfg.decoding.prompt_logprobs = 3, 2
    worker = GenerationWorker(to_dict(cfg), {"run_id": "p", "head_dir": artifacts["head"],
                                             "trie_url": artifacts["trie"]})
    rows = [input_row("a", "w5 w6 w7"), input_row("b", "w8 w9", prompt_logprobs=0),
            input_row("c", "w10", prompt_logprobs=-1)]
    out = worker(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)).to_pylist()
    encoded = worker._encode(rows[0])
    assert len(out[0]["prompt_logprobs"]) == len(encoded) and out[0]["prompt_logprobs"][0] is None
    assert all(len(ids) == 2 for ids in out[0]["prompt_top_logprob_ids"][1:])
    assert out[1]["prompt_logprobs"] is None
    assert out[2]["finish_reason"] == "error" and "prompt_logprobs must be >= 0" in out[2]["error"]
