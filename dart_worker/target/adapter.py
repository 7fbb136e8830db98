"""Target adapter: one Hugging Face causal LM driven for tree speculative decoding.

The adapter owns what the decoding loop needs from the target and nothing else:

- a ragged KV cache (`target_state.TargetState`, a module of its own): sequence b's committed
  tokens occupy cache slots [0, lengths[b]) contiguously (slot index == absolute position);
  slots past that are stale and always masked out, so sequences of different lengths share one
  cache tensor;
- forwards over a block of new rows (a prompt, or a flattened draft tree) with an explicit
  attention mask: full view of the committed prefix, an arbitrary relation inside the block
  (causal for prompts, ancestor-only for trees), and per layer type the sliding window;
- hidden-state taps at the inputs of three decoder layers (forward pre-hooks, so no other
  layer's hidden states are kept), fused low/mid/high for the draft head;
- compaction after verification: the accepted rows' keys/values move to the slots right
  after each sequence's prefix, everything else is dropped.

Masks are handed to transformers ready-made: a 4D boolean tensor, or for models with
sliding-window layers (Gemma3, Qwen3 with sliding layers) a dict keyed by layer type, which
the model uses as is instead of building its own. Every layer keeps a full-length cache
(`kv_cache.GrowingCache`: a `DynamicCache` without a config, appended in place): sliding windows
are applied through the masks, so all layers share one slot layout and compaction is the same
gather for every layer.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from dart_worker.hardware.transfer import move_to, to_device
from dart_worker.target import tree_attention
from dart_worker.target.kv_cache import GrowingCache, per_device
from dart_worker.target.packed_rows import PackedRows, packing
from dart_worker.target.projection import project
from dart_worker.target.shape_buckets import context_bucket
from dart_worker.target.target_state import TargetState

# Attention implementations that take explicit 4D masks (flash kernels ignore them): sdpa and
# dart_tree (`dart_worker.target.tree_attention`, which the adapter puts in sdpa's place) boolean ones,
# eager additive ones (`TargetAdapter._mask_format`).
TREE_MASK_ATTENTION = ("dart_tree", "sdpa", "eager")
# Relative difference allowed between the model's own logits and the adapter's (the same product,
# in another orientation or row grouping: float rounding only; a missing logit scale is far more).
HEAD_CHECK_TOLERANCE = 1e-2
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def cache_argument(decoder: torch.nn.Module) -> str:
    """The decoder forward's name for the KV cache: `cache` from transformers 5.24 on (which warns
    about the old name and removes it in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def module_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: the execution device accelerate's hook gives it in a target spread
    over several devices (its weights may sit elsewhere: offloaded ones are on "meta"), else the
    device of its first parameter."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def default_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """DART/EAGLE-3 taps: inputs of layers 2, L//2 and L-3 (clamped for very shallow models)."""
    last = num_layers - 1
    return (min(2, last), min(num_layers // 2, last), max(0, min(num_layers - 3, last)))


def _pad_slots(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """[..., T, D] zero-padded to T = slots (cache tensors [B, H, T, D], taps [B, T, F])."""
    missing = slots - tensor.shape[-2]
    return tensor if missing == 0 else torch.nn.functional.pad(tensor, (0, 0, 0, missing))


# Padded tokens a prefill block may carry per real prompt token (see `prefill_groups`).
PREFILL_MAX_PADDING = 1.25


def prefill_groups(lengths: Sequence[int], max_padding: float = PREFILL_MAX_PADDING) -> list[list[int]]:
    """Prompt indices in groups to prefill together, longest first: a group grows by the next
    longest prompt while its padded block (members x longest) stays within `max_padding` times
    its real tokens. On a CPU a forward's cost is linear in its padded tokens; on a GPU a few
    forwards over similar lengths cost little more than one."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_padding * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, R, V] in the model dtype, for the requested rows (None: not computed)
    taps: torch.Tensor  # [B, S, 3 * hidden] fused hidden states of every new row, on `TargetAdapter.device`
    hidden: torch.Tensor | None = None  # [B, S, hidden] final-norm states, when logits were deferred


class TargetAdapter:
    """Drives `model` for prefill, tree verification and KV compaction (see module doc)."""

    def __init__(self, model: PreTrainedModel, tap_layers: Sequence[int] | None = None):
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no decoder layer list (model.model.layers)")
        self.num_layers = len(layers)
        self._deferral_pays: bool | None = None  # see deferred_logits_pay
        self.tap_layers = tuple(tap_layers) if tap_layers is not None else default_tap_layers(self.num_layers)
        if len(self.tap_layers) != 3 or not all(0 <= i < self.num_layers for i in self.tap_layers):
            raise ValueError(f"tap_layers must be 3 layer indices in [0, {self.num_layers}), got {self.tap_layers}")
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.layer_types = list(getattr(self.config, "layer_types", None) or [FULL_ATTENTION] * self.num_layers)
        self.sliding_window = getattr(self.config, "sliding_window", None)
        self.uses_mask_dict = SLIDING_ATTENTION in self.layer_types
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        if attention == "sdpa":  # the same attention, with grouped K/V heads kept unexpanded
            tree_attention.install(model)
            attention = tree_attention.NAME
        if attention not in TREE_MASK_ATTENTION:
            raise ValueError(f"{type(model).__name__} runs attention {attention!r}, which does not take the "
                             f"ready-made tree masks this engine passes; load it with attn_implementation "
                             f"one of {TREE_MASK_ATTENTION}")
        # sdpa reads a boolean mask as "may attend"; eager *adds* the mask to the scores, so a
        # boolean one would add 0/1 and mask nothing: it gets 0 / -inf-like float masks instead.
        self._additive_masks = attention == "eager"
        # Packed real rows (`forward`'s `packed`) need the attention function that spreads them.
        self.packs_rows = attention == tree_attention.NAME
        self._captured: dict[int, torch.Tensor] = {}
        for index in sorted(set(self.tap_layers)):
            layers[index].register_forward_pre_hook(self._make_tap_hook(index), with_kwargs=True)
        self._cache_argument = cache_argument(decoder)
        self._check_logits_head()

    @torch.no_grad()
    def _check_logits_head(self) -> None:
        """The adapter computes logits as `logits_at(decoder(...))` (see `forward`); check once, on a
        few tokens, that this is what the model's own forward computes, so that a model with an
        extra logit scale or a head of its own fails here, naming the difference, instead of
        decoding something else than its own greedy output."""
        probe = (torch.arange(4, device=self.device) * 7 + 1)[None] % self.vocab_size
        try:
            theirs = self.model(input_ids=probe, use_cache=False).logits.float()
            ours = self.logits_at(self.model.get_decoder()(input_ids=probe, use_cache=False).last_hidden_state)
        finally:
            self._captured.clear()
        ours = ours.float().to(theirs.device)
        if theirs.shape != ours.shape:
            raise ValueError(f"{type(self.model).__name__}: its forward gives logits of shape {tuple(theirs.shape)}, "
                             f"LM head over the decoder's output {tuple(ours.shape)}; unsupported model head")
        scale = float(theirs.abs().max())
        error = float((theirs - ours).abs().max())
        if not error <= HEAD_CHECK_TOLERANCE * scale + 1e-5:
            raise ValueError(f"{type(self.model).__name__}: its logits are not the LM head (and final soft-capping) "
                             f"over the decoder's output: max difference {error:.3g} at logits up to {scale:.3g}; "
                             "a model with another logit transform is not supported")

    @property
    def device(self) -> torch.device:
        """The engine's device: where the token embedding is (input ids, positions, masks, trees,
        taps and the draft head live there). A target spread over several devices (`load_target`'s
        `devices`) keeps its other layers elsewhere: each layer's KV cache lives on its own device
        (accelerate's hooks move a layer's inputs there), the logits on `logits_device`."""
        return module_device(self.model.get_input_embeddings())

    @property
    def logits_device(self) -> torch.device:
        """Where the LM head computes, so where logits are (the last device of a split target)."""
        return module_device(self.model.get_output_embeddings())

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def _make_tap_hook(self, index: int):
        def hook(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self._captured[index] = hidden

        return hook

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's own (frozen) token embeddings, as the draft head consumes them."""
        return self.model.get_input_embeddings()(token_ids)

    def new_state(self, batch_size: int) -> TargetState:
        return TargetState(GrowingCache(), np.zeros(batch_size, dtype=np.int64))

    # ------------------------------------------------------------------ masks

    def _attention_masks(self, state: TargetState, positions: torch.Tensor, block: torch.Tensor):
        """Masks for new rows at `positions` [B, S] whose relation inside the block is `block` [B, S, S].

        Cache slot j holds absolute position j, visible to sequence b iff j < lengths[b].
        """
        batch, rows = positions.shape
        cached = state.cache_len()
        slot = torch.arange(cached, device=positions.device)
        prefix = slot[None, None, :] < state.device_lengths(positions.device)[:, None, None]  # [B, 1, T]
        prefix = prefix.expand(batch, rows, cached)
        full = torch.cat([prefix, block], dim=-1)  # [B, S, T + S]
        if not self.uses_mask_dict:
            return self._mask_format(full[:, None])
        key_pos = torch.cat([slot[None].expand(batch, cached), positions], dim=-1)  # [B, T + S]
        in_window = (positions[:, :, None] - key_pos[:, None, :]) < int(self.sliding_window)
        return {FULL_ATTENTION: self._mask_format(full[:, None]),
                SLIDING_ATTENTION: self._mask_format((full & in_window)[:, None])}

    def _mask_format(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean "may attend" mask as the model's attention implementation reads masks."""
        if not self._additive_masks:
            return allowed
        return torch.zeros((), dtype=self.dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min)

    # ---------------------------------------------------------------- forward

    @torch.no_grad()
    def forward(
        self,
        state: TargetState,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
        defer_logits: bool = False,
        packed: PackedRows | None = None,
    ) -> ForwardOutput:
        """Run new rows through the target and append their K/V after the current cache slots.

        input_ids/positions: [B, S]; block: [B, S, S] bool (row may attend to column);
        logit_rows: [B, R] row indices whose logits are needed (None = all rows).
        packed: the only rows anyone reads (a verify block's roots and nodes: `TreeBatch.packed`):
        where the model runs the tree attention (`packs_rows`), only they run, packed into one row
        (`dart_worker.target.packed_rows`): decoder and vocabulary projection alike,
        which on a CPU is most of what a padding row costs. Logits, hidden states and taps keep
        their [B, S, ...] shape; the other rows' values are unspecified (hidden states and taps are
        zeros), and their cache slots hold zeros (never committed).
        defer_logits: return the final hidden states instead of logits; `logits_at` turns the
        rows that turn out to be needed into logits (the vocabulary projection is most of a
        small forward's cost on a CPU, and a greedy walk reads only a few rows of a tree).
        The appended slots are not committed: call `commit` to keep the accepted ones.
        """
        masks = self._attention_masks(state, positions, block)
        self._captured.clear()
        layout = packed if self.packs_rows else None
        if layout is not None:
            input_ids, positions = layout.pack(input_ids)[None], layout.pack(positions)[None]
        # One path on every device: the decoder, then the rows that are needed through the LM
        # head (`logits_at`). The model's own forward is not used for logits, because what it
        # does with a tensor `logits_to_keep` depends on the transformers version (4.x indexed
        # `hidden[:, logits_to_keep]`, giving [B, B, R, V] for a [B, R] tensor; 5.x gathers per
        # sample): correctness must not rest on which one is installed.
        with packing(layout):
            hidden = self.model.get_decoder()(input_ids=input_ids, attention_mask=masks, position_ids=positions,
                                              use_cache=True, **{self._cache_argument: state.cache}).last_hidden_state
        logits = None
        if not defer_logits:
            if logit_rows is not None:  # the final norm's output is on the last layers' device
                hidden = torch.take_along_dim(hidden, move_to(logit_rows[..., None], hidden.device), dim=1)
            logits = self.logits_at(hidden)
            hidden = None
        # Each tap is captured on its layer's device; the draft head reads them on the engine's.
        taps = torch.cat([move_to(self._captured[i], self.device) for i in self.tap_layers], dim=-1)
        self._captured.clear()
        if layout is not None:  # back into the block's [B, S] places (padding logits unspecified)
            logits = None if logits is None else layout.spread(logits[0], zeros=False)
            hidden, taps = (None if x is None else layout.spread(x[0]) for x in (hidden, taps))
        # Logits stay in the model dtype: [rows, vocab] in float32 would cost more than the
        # verification that reads them (which upcasts only the rows it uses).
        return ForwardOutput(logits=logits, taps=taps, hidden=hidden)

    def deferred_logits_pay(self, tree_rows: int = 16, walk_rows: int = 3) -> bool:
        """Measured once per adapter: is projecting `walk_rows` rows one at a time (a greedy walk
        over deferred logits) cheaper than one projection of a `tree_rows`-row tree?

        Where the projection's cost grows with its rows, deferring pays; where a matrix unit (AMX
        bf16, a GPU) or MKL's faster orientation (`logits_at`, fp32 CPUs) makes 16 rows cost about
        as much as a few single ones, it does not. Which side wins is too close to call by device
        kind, hence a measurement (docs/benchmarks.md).
        """
        if self._deferral_pays is None:
            self._deferral_pays = walk_rows * self.projection_seconds(1) < self.projection_seconds(tree_rows)
        return self._deferral_pays

    def projection_seconds(self, rows: int) -> float:
        """Measured seconds of `logits_at` over `rows` random hidden rows: the median of 3 after a
        warm-up call (first calls pay one-time costs)."""
        device = self.logits_device
        hidden = torch.randn(rows, self.config.hidden_size, dtype=self.dtype, device=device)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            self.logits_at(hidden)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[1]

    @torch.no_grad()
    def logits_at(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states [..., hidden], exactly as the model's own head computes
        them: the LM head (through `projection.project`: one contiguous matrix, in the orientation
        a CPU runs fastest), then the final soft-capping where the model has one (Gemma 2). Computed
        on the LM head's device (`logits_device`), where `hidden` is moved first."""
        logits = project(move_to(hidden, self.logits_device), self.model.get_output_embeddings())
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def prefill(self, state: TargetState, prompts: Sequence[Sequence[int]], keep_hidden: bool = False) -> ForwardOutput:
        """Forward whole prompts; logits only at each last token. Afterwards sequence b holds
        len(prompts[b]) committed tokens. `keep_hidden`: also return the final hidden states of
        every prompt row (`ForwardOutput.hidden`, [B, S, hidden]), from which `logits_at` gives
        any row's logits (prompt logprobs) without projecting every row to the vocabulary here.

        A right-padded block costs its longest prompt's length for every row, and prompt lengths
        are heavy-tailed (16 ShareGPT prompts: 5x as many padded tokens as real ones), so a fresh
        state is prefilled in groups of similar length (`prefill_groups`), whose caches are joined
        and put back in the prompts' order. Results equal one block's: each row sees only its own
        prompt either way.
        """
        groups = prefill_groups([len(p) for p in prompts])
        if len(groups) == 1 or state.cache_len():
            return self._prefill_block(state, prompts, keep_hidden)
        outs, joined = [], None
        for group in groups:
            part = TargetState(GrowingCache(), state.lengths[group])
            outs.append(self._prefill_block(part, [prompts[i] for i in group], keep_hidden))
            if joined is None:
                joined = part
            else:
                joined.extend(part)
        order = np.array([i for group in groups for i in group])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        joined.select(inverse.tolist())
        state.cache, state.lengths = joined.cache, joined.lengths
        width = max(out.taps.shape[1] for out in outs)
        taps = torch.cat([_pad_slots(out.taps, width) for out in outs])
        index = per_device(inverse)  # logits on the LM head's device, taps on the engine's
        logits = torch.cat([out.logits for out in outs])
        hidden = torch.cat([_pad_slots(out.hidden, width) for out in outs]) if keep_hidden else None
        return ForwardOutput(logits=logits[index(logits.device)], taps=taps[index(taps.device)],
                             hidden=None if hidden is None else hidden[index(hidden.device)])

    def _prefill_block(self, state: TargetState, prompts: Sequence[Sequence[int]],
                       keep_hidden: bool = False) -> ForwardOutput:
        """`prefill` in one forward: prompts right-padded into one block."""
        device = self.device
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        width = int(lengths.max())
        packed = np.zeros((3, len(prompts), width), dtype=np.int64)  # ids, positions, last row
        for b, prompt in enumerate(prompts):
            packed[0, b, : len(prompt)] = prompt
        packed[1] = state.lengths[:, None] + np.arange(width)[None, :]
        packed[2, :, 0] = lengths - 1
        input_ids, positions, last = to_device(packed, device).unbind(0)  # one upload
        col = torch.arange(width, device=device)
        valid = col[None, :] <= last[:, :1]
        causal = col[None, :, None] >= col[None, None, :]
        # Padding rows attend to themselves only, so no softmax runs over an empty row.
        block = (causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None]
        out = self.forward(state, input_ids, positions, block, logit_rows=last[:, :1], defer_logits=keep_hidden)
        if keep_hidden:  # the last rows' logits from the kept states, as `forward` computes them
            last_rows = torch.take_along_dim(out.hidden, move_to(last[:, :1, None], out.hidden.device), dim=1)
            out = ForwardOutput(logits=self.logits_at(last_rows), taps=out.taps, hidden=out.hidden)
        state.lengths = state.lengths + lengths
        self._crop(state, int(state.lengths.max()))
        return out

    def verify(self, state: TargetState, tokens: torch.Tensor, depths: torch.Tensor,
               ancestor: torch.Tensor, defer_logits: bool = False, bucketed: bool = False,
               packed: PackedRows | None = None) -> ForwardOutput:
        """Forward flattened trees [B, S] (column 0 = root = last committed token, not yet cached).

        Positions are committed length + depth; attention is ancestor-only inside the tree.
        Returns logits at every row (row i predicts the token after row i's path), or with
        `defer_logits` the final hidden states of every row (see `forward`). `packed`: the rows
        that are roots or nodes (`TreeBatch.packed`), the only ones that run where the model packs
        rows (see `forward`): where a forward costs its rows (a CPU), a
        block of unequal trees then pays for its real rows only, not for the padding. `bucketed`: the
        cached context is first widened to its bucket (`shape_buckets.context_bucket`; the block
        then starts there: read it as `state.cache_len() - S` afterwards).
        """
        if bucketed:
            state.cache.pad_slots(context_bucket(state.cache_len()))
        positions = state.device_lengths(depths.device)[:, None] + depths
        return self.forward(state, tokens, positions, ancestor, defer_logits=defer_logits, packed=packed)

    # ------------------------------------------------------------- compaction

    @torch.no_grad()
    def commit(self, state: TargetState, block_start: int, accepted_rows: Sequence[Sequence[int]]) -> None:
        """Keep the K/V of `accepted_rows[b]` (row indices within the last block, in path order).

        They move to slots lengths[b], lengths[b] + 1, ...; the rest of the block is dropped.
        Destination slots never exceed source slots, and the gather reads before it writes.
        """
        counts = np.array([len(rows) for rows in accepted_rows], dtype=np.int64)
        total = int(counts.sum())
        if total:
            # (sequence, source slot, destination slot) of every kept row, built on the host from
            # the host lengths and uploaded in one non-blocking copy.
            index = np.empty((3, total), dtype=np.int64)
            index[0] = np.repeat(np.arange(len(counts)), counts)
            index[1] = block_start + np.concatenate([np.asarray(rows, dtype=np.int64) for rows in accepted_rows])
            index[2] = np.repeat(state.lengths, counts) + (np.arange(total) - np.repeat(np.cumsum(counts) - counts,
                                                                                          counts))
            on = per_device(index)  # each layer's cache is indexed on its own device
            for layer in state.cache.layers:
                b_t, src_t, dst_t = on(layer.keys.device).unbind(0)
                layer.keys[b_t, :, dst_t] = layer.keys[b_t, :, src_t]
                layer.values[b_t, :, dst_t] = layer.values[b_t, :, src_t]
        state.lengths = state.lengths + counts
        self._crop(state, int(state.lengths.max()) if len(counts) else 0)

    @staticmethod
    def _crop(state: TargetState, keep: int) -> None:
        for layer in state.cache.layers:
            if layer.keys is not None and layer.keys.shape[-2] > keep:
                layer.keys = layer.keys[:, :, :keep]
                layer.values = layer.values[:, :, :keep]
