"""Training pieces of the DART draft head: teacher pass, prefix-shared MASK blocks, the loss.

Pure torch (no ray): `dart_train/trainer.py` drives these from a local loop or from Ray Train.

Pairing (identical to `DartDraftHead.draft_logits`, see dart_worker/head/draft_head.py). A sequence has
tokens x_0..x_{L-1}; the target's taps f_j and logits l_j (l_j is the distribution of x_{j+1}).
Real draft row j (j = 0..L-2) pairs f_j with the embedding of x_{j+1} at position j. For an
anchor p (the last committed position of a decoding round; x_{p+1} is the bonus token):

    draft row 0  = real row p                       -> teacher l_{p+1} (predicts x_{p+2})
    draft row i  = MASK row at position p+i, i=1..m -> teacher l_{p+1+i}

Row layout of one training sequence: the L-1 real rows, then K blocks of m MASK rows, one per
sampled anchor. Attention (`block_attention_mask`): real rows are causal among themselves; MASK
row i of the block of anchor p sees real rows 0..p and MASK rows 1..i of its own block; no block
sees another block and no real row sees a MASK row. This is exactly the DART prefix-shared block
mask restricted to the sampled anchors: a row's output depends only on what it may attend to,
so dropping the blocks of other anchors changes no surviving row.

Loss (`dart_kl_loss`): sum over t = 0..m of gamma^t * mean over valid (anchor, t) of
KL(p_target || q_draft). Row 0 of *every* anchor comes for free (it is the real row), so its term
averages over all anchors, the MASK terms over the sampled ones; both are unbiased estimates of
the same per-anchor expectation, so sampling K anchors per sequence changes the variance, not
the objective.

Teacher and the draft vocabulary: the teacher is the target's distribution restricted to the
draft vocabulary and renormalised there, softmax(l[kept]), i.e. the target distribution
conditioned on the next token being drafteable. Out-of-vocabulary mass is dropped: the draft
cannot propose such tokens anyway, and keeping it as an extra "other" class would only teach
the draft to spread mass on nothing it can use. The evaluation reports how much mass is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dart_worker.head.draft_head import DartDraftHead
from dart_worker.target.adapter import default_tap_layers

# ------------------------------------------------------------------------------------ teacher


@dataclass
class TeacherOutput:
    taps: torch.Tensor  # [B, S, 3*H_t] fused hidden states (low, mid, high), the target's dtype
    logits: torch.Tensor  # [B, S, V_draft] float32 target logits over the draft vocabulary
    argmax: torch.Tensor | None = None  # [B, S] full-vocabulary argmax (target ids), if asked
    in_vocab_mass: torch.Tensor | None = None  # [B, S] target probability of the draft vocabulary


class TeacherPass:
    """Runs the frozen target over whole right-padded sequences and returns taps + teacher logits.

    Right padding needs no attention mask: attention is causal, so a real row never sees the
    padding after it. Only the draft-vocabulary rows of the LM head are applied (the full
    262k-row head would cost more than the rest of a small target); `full_vocab=True` also
    computes the full-vocabulary argmax and in-vocabulary mass (evaluation only).
    """

    def __init__(self, model: nn.Module, kept_target_ids: torch.Tensor,
                 tap_layers: Sequence[int] | None = None) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        layers = self.decoder.layers
        self.tap_layers = tuple(tap_layers) if tap_layers is not None else default_tap_layers(len(layers))
        self.layers = layers
        head = model.get_output_embeddings()
        self.lm_weight = head.weight
        self.lm_bias = getattr(head, "bias", None)
        self.kept = torch.as_tensor(kept_target_ids, dtype=torch.long, device=self.lm_weight.device)
        config = model.config.get_text_config(decoder=True)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def _project(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        weight = self.lm_weight if rows is None else self.lm_weight[rows]
        bias = None if self.lm_bias is None else (self.lm_bias if rows is None else self.lm_bias[rows])
        logits = F.linear(hidden, weight, bias).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, full_vocab: bool = False) -> TeacherOutput:
        captured: dict[int, torch.Tensor] = {}

        def make_hook(index: int):
            def hook(_module, args, kwargs):
                captured[index] = args[0] if args else kwargs["hidden_states"]
            return hook

        handles = [self.layers[i].register_forward_pre_hook(make_hook(i), with_kwargs=True)
                   for i in sorted(set(self.tap_layers))]
        try:
            hidden = self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state
        finally:
            for h in handles:
                h.remove()
        taps = torch.cat([captured[i] for i in self.tap_layers], dim=-1)
        out = TeacherOutput(taps=taps, logits=self._project(hidden, self.kept))
        if full_vocab:
            argmax, mass = [], []
            for chunk in hidden.split(64, dim=1):  # [B, 64, V] at a time: bounded memory
                full = self._project(chunk, None)
                argmax.append(full.argmax(-1))
                mass.append(torch.exp(torch.logsumexp(full[..., self.kept], -1) - torch.logsumexp(full, -1)))
            out.argmax, out.in_vocab_mass = torch.cat(argmax, 1), torch.cat(mass, 1)
        return out


def tap_rms(taps: torch.Tensor, lengths: torch.Tensor, num_taps: int = 3) -> torch.Tensor:
    """Root-mean-square of each tapped layer's hidden states [num_taps] over real positions >= 1.

    Position 0 (BOS) is left out: it is the attention sink of many models, with hidden states
    one or two orders of magnitude larger than anywhere else.
    """
    _, seq, width = taps.shape
    pos = torch.arange(seq, device=taps.device)
    valid = (pos[None] >= 1) & (pos[None] < lengths.to(taps.device)[:, None])
    if not bool(valid.any()):
        raise ValueError("tap_rms needs at least one sequence with two or more tokens")
    blocks = taps[valid].float().view(-1, num_taps, width // num_taps)
    return blocks.pow(2).mean((0, 2)).sqrt()


@torch.no_grad()
def scale_fc_to_taps(head: DartDraftHead, rms: torch.Tensor) -> None:
    """Divide fc's input columns of tap i by rms[i] (data-dependent init, architecture unchanged).

    Why: fc's output is the residual stream of real rows, and the token embedding of x_{p+1}
    reaches row 0 only through attention (output rms ~1). Targets with large hidden states
    (Gemma-3-270M: rms ~35 / ~230 / ~800 at layers 2 / 9 / 15) would make fc(features) ~100x
    larger than the attention output under the default init, so the draft would mostly ignore
    the next token until fc had shrunk by two orders of magnitude. After scaling, fc(features)
    has rms ~ 1/sqrt(3), like a unit-variance input.
    """
    width = head.fc.weight.shape[1] // rms.numel()
    for i, value in enumerate(rms.tolist()):
        head.fc.weight[:, i * width : (i + 1) * width] /= max(value, 1e-6)


# ------------------------------------------------------------------------- rows and mask


def sample_anchors(lengths: torch.Tensor, loss_starts: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K = num_anchors distinct anchors per sequence, uniform over [loss_start, length-3].

    An anchor p needs at least one MASK row with a teacher (l_{p+2}, so p <= L-3). Returns
    anchors [B, K] (long) and a validity mask [B, K]; sequences with fewer than K candidates
    get all of them, and padding anchors (valid = False) point at position 0.
    """
    batch = lengths.shape[0]
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)
    valid = torch.zeros(batch, num_anchors, dtype=torch.bool)
    for b in range(batch):
        low, high = int(loss_starts[b]), int(lengths[b]) - 3
        count = high - low + 1
        if count <= 0:
            continue
        if count <= num_anchors:
            chosen = torch.arange(low, high + 1)
        else:
            chosen = low + torch.randperm(count, generator=generator)[:num_anchors].sort().values
        anchors[b, : len(chosen)] = chosen
        valid[b, : len(chosen)] = True
    return anchors, valid


def block_attention_mask(num_real: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean mask [B, 1, R, R] (True = may attend), R = num_real + K * block_size.

    Rows 0..num_real-1 are the real rows (causal); then block k holds MASK rows 1..block_size of
    anchor anchors[b, k], which see real rows 0..anchor and their own block causally.
    """
    device = anchors.device
    batch, k = anchors.shape
    m = block_size
    real = torch.arange(num_real, device=device)
    causal = real[:, None] >= real[None, :]  # [n, n]
    top = torch.cat((causal, torch.zeros(num_real, k * m, dtype=torch.bool, device=device)), dim=1)
    top = top[None].expand(batch, -1, -1)
    # MASK rows -> real rows: column j visible iff j <= anchor of the row's block.
    row_anchor = anchors.repeat_interleave(m, dim=1)  # [B, K*m]
    to_real = real[None, None, :] <= row_anchor[:, :, None]  # [B, K*m, n]
    block_id = torch.arange(k * m, device=device) // m
    within = torch.arange(k * m, device=device) % m
    to_mask = (block_id[:, None] == block_id[None, :]) & (within[:, None] >= within[None, :])
    bottom = torch.cat((to_real, to_mask[None].expand(batch, -1, -1)), dim=2)
    return torch.cat((top, bottom), dim=1)[:, None]


def draft_training_logits(head: DartDraftHead, taps: torch.Tensor, input_ids: torch.Tensor,
                          anchors: torch.Tensor, rows: LossRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits of every real row and every sampled MASK block, in one forward.

    taps [B, S, 3H_t], input_ids [B, S], anchors [B, K]. Returns real-row logits [B, S-1, Vd]
    (real row j = draft row 0 of anchor j) and MASK logits [B, K, m, Vd] (row i-1 of block k =
    draft row i of anchor anchors[b, k]). Float32, differentiable w.r.t. the head.

    With `rows` (`loss_rows`), only the rows the loss reads get the vocabulary projection:
    real logits [N0, Vd] for the True entries of rows.real in row-major order, MASK logits
    [N1, Vd] for those of rows.mask, which is what `dart_kl_loss` takes. The projection to the
    draft vocabulary (and its backward) is most of a step's cost, and rows outside the loss
    region (prompt tokens, padding, anchors near a sequence's end) are a third to a half of all
    rows on chat data; every other row still attends and is attended to exactly as before.
    """
    cfg, layer = head.config, head.midlayer
    m = cfg.draft_length
    batch, seq = input_ids.shape
    n = seq - 1
    k = anchors.shape[1]
    dtype = head.dtype
    hidden = head.fc(taps[:, :n].to(dtype))
    with torch.no_grad():
        embeds = head.embed_tokens(input_ids[:, 1:]).to(dtype)
    x_real = layer.attention_input(embeds, hidden)
    x_mask, residual_mask = layer.mask_rows(batch, k * m)
    attn_in = torch.cat((x_real, x_mask.to(x_real.dtype)), dim=1)
    residual = torch.cat((hidden, residual_mask.to(hidden.dtype)), dim=1)
    offsets = torch.arange(1, m + 1, device=anchors.device)
    positions = torch.cat((torch.arange(n, device=anchors.device)[None].expand(batch, -1),
                           (anchors[:, :, None] + offsets).reshape(batch, k * m)), dim=1)
    cos, sin = head.rope(positions.to(head.device), attn_in.dtype)
    allowed = block_attention_mask(n, anchors.to(head.device), m)
    hidden_out = layer(attn_in, residual, cos, sin, allowed)
    if rows is not None:
        real_rows = hidden_out[:, :n][rows.real.to(hidden_out.device)]
        mask_rows = hidden_out[:, n:].reshape(batch, k, m, -1)[rows.mask.to(hidden_out.device)]
        out = head.logits(torch.cat((real_rows, mask_rows)))
        return out[: len(real_rows)], out[len(real_rows):]
    out = head.logits(hidden_out)
    return out[:, :n], out[:, n:].reshape(batch, k, m, -1)


# ------------------------------------------------------------------------------------ loss


@dataclass
class TopKTeacher:
    """A teacher kept as its top-k draft ids, their log-probabilities and the remaining mass.

    ids [..., k] (draft ids, most probable first), logprobs [..., k] (log p over the whole draft
    vocabulary, float32) and rest [...] = 1 - sum(exp(logprobs)) (the mass of the other Vd - k
    ids, computed from the logits, not by subtraction). Indexing applies to the leading axes, so
    `dart_kl_loss` selects teacher rows of a TopKTeacher exactly as of a dense logits tensor.
    This is what the teacher cache stores (dart_train/teacher_cache.py); with k = Vd it is exact.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    rest: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.ids.shape)

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def __getitem__(self, index) -> TopKTeacher:
        return TopKTeacher(self.ids[index], self.logprobs[index], self.rest[index])

    def to(self, device) -> TopKTeacher:
        return TopKTeacher(self.ids.to(device), self.logprobs.to(device), self.rest.to(device))

    def argmax(self, dim: int = -1) -> torch.Tensor:
        if dim != -1:
            raise ValueError("TopKTeacher.argmax works over the vocabulary axis only")
        return self.ids[..., 0].long()


def top_k_teacher(teacher_logits: torch.Tensor, k: int) -> TopKTeacher:
    """The top-k form of dense teacher logits [..., Vd] over the draft vocabulary (k <= Vd)."""
    logits = teacher_logits.float()
    k = min(k, logits.shape[-1])
    log_p = F.log_softmax(logits, dim=-1)
    top = log_p.topk(k, dim=-1)  # sorted: most probable first
    if k == logits.shape[-1]:
        rest = torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    else:
        others = log_p.scatter(-1, top.indices, float("-inf"))
        rest = torch.logsumexp(others, dim=-1).exp()
    return TopKTeacher(top.indices, top.values, rest)


_MASKED = -1.0e30  # finite "minus infinity": no NaN gradients when every id is in the top k


def kl_per_row(teacher_logits: torch.Tensor | TopKTeacher, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher || q_draft) per row over the last axis (forward KL: teacher-weighted).

    A `TopKTeacher` gives the KL of the two distributions coarsened to k + 1 outcomes: the
    teacher's top-k ids one by one and "any other draft id" as one bucket (teacher mass `rest`,
    draft mass 1 - q(top-k)). By the chain rule of KL,
    KL_full = KL_coarse + rest * KL(p_tail / rest || q_tail / q_rest) >= KL_coarse: the gap is
    the remaining mass times how differently the two spread it inside the tail; it is 0 when
    k = Vd (rest = 0) or when the draft's tail is proportional to the teacher's.
    """
    if isinstance(teacher_logits, TopKTeacher):
        draft = draft_logits.float()
        log_norm = torch.logsumexp(draft, dim=-1)
        ids = teacher_logits.ids.long()
        log_q_top = draft.gather(-1, ids) - log_norm[..., None]
        log_p_top = teacher_logits.logprobs.float()
        kl_top = (log_p_top.exp() * (log_p_top - log_q_top)).sum(-1)
        log_q_rest = torch.logsumexp(draft.scatter(-1, ids, _MASKED), dim=-1) - log_norm
        rest = teacher_logits.rest.float()
        return kl_top + torch.xlogy(rest, rest) - rest * log_q_rest
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar: sum_t gamma^t * mean KL of draft row t
    kl_per_position: torch.Tensor  # [D] mean KL of draft row t (detached)
    accuracy_per_position: torch.Tensor  # [D] top-1 agreement with the teacher's argmax (detached)
    count_per_position: torch.Tensor  # [D] number of (anchor, row) pairs that entered each mean


def teacher_targets(teacher_logits: torch.Tensor | TopKTeacher, anchors: torch.Tensor,
                    mask_rows: torch.Tensor) -> torch.Tensor | TopKTeacher:
    """Teacher logits for MASK row i of anchor p, l_{p+1+i}, for the True entries of mask_rows
    [B, K, m] (`LossRows.mask`, row-major): [N1, Vd]. Only those rows are gathered."""
    b, k, i = mask_rows.nonzero(as_tuple=True)
    return teacher_logits[b, anchors[b, k] + 2 + i]


@dataclass
class LossRows:
    """Which rows the loss reads: real [B, S-1] (draft row 0 at anchor p, p in [loss_start, L-2])
    and mask [B, K, m] (MASK row i of a valid sampled anchor p, with p+1+i <= L-1)."""

    real: torch.Tensor
    mask: torch.Tensor


def loss_rows(lengths: torch.Tensor, loss_starts: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor,
              seq: int, draft_length: int) -> LossRows:
    dev = anchors.device
    lengths, loss_starts, anchor_valid = lengths.to(dev), loss_starts.to(dev), anchor_valid.to(dev)
    p = torch.arange(seq - 1, device=dev)
    real = (p[None] >= loss_starts[:, None]) & (p[None] <= lengths[:, None] - 2)
    i = torch.arange(1, draft_length + 1, device=dev)
    mask = anchor_valid[:, :, None] & (anchors[:, :, None] + 1 + i <= lengths[:, None, None] - 1)
    return LossRows(real, mask)


def dart_kl_loss(teacher_logits: torch.Tensor | TopKTeacher, real_logits: torch.Tensor, mask_logits: torch.Tensor,
                 lengths: torch.Tensor, loss_starts: torch.Tensor, anchors: torch.Tensor,
                 anchor_valid: torch.Tensor, gamma: float = 0.6, draft_length: int | None = None) -> LossTerms:
    """The DART objective on one batch (see the module docstring for the pairing and weights).

    teacher_logits [B, S, Vd] (or a TopKTeacher [B, S, k], see `kl_per_row`); lengths and
    loss_starts [B]: row 0 is trained for anchors p in [loss_start, L-2], MASK row i for sampled
    valid anchors with p+1+i <= L-1 (`loss_rows`). The draft logits come either dense, real_logits
    [B, S-1, Vd] and mask_logits [B, K, m, Vd], or as only the rows the loss reads,
    [N0, Vd] and [N1, Vd] in `loss_rows` order (draft_training_logits with `rows`; then pass
    `draft_length`): the loss is the same either way, only fewer rows are computed.
    """
    _batch, seq, _ = teacher_logits.shape
    dense = mask_logits.dim() == 4
    m = mask_logits.shape[2] if dense else draft_length
    if m is None:
        raise ValueError("dart_kl_loss: pass draft_length with row-selected (2-D) mask logits")
    dev = teacher_logits.device
    rows = loss_rows(lengths, loss_starts, anchors.to(dev), anchor_valid, seq, m)
    if dense:
        real_logits, mask_logits = real_logits[rows.real], mask_logits[rows.mask]
    row0_teacher = teacher_logits[:, 1:][rows.real]
    kl0 = kl_per_row(row0_teacher, real_logits)
    acc0 = real_logits.argmax(-1) == row0_teacher.argmax(-1)

    targets = teacher_targets(teacher_logits, anchors.to(dev), rows.mask)
    kl_mask = kl_per_row(targets, mask_logits)  # [N1]
    acc_mask = mask_logits.argmax(-1) == targets.argmax(-1)
    position = rows.mask.nonzero()[:, 2]  # MASK row i - 1 of each selected row

    def by_position(row0: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:  # [D] sums
        masked = masked.float()
        return torch.cat((row0.float().sum()[None], torch.zeros(m, device=dev).index_add(0, position, masked)))

    counts = torch.cat((rows.real.sum()[None], rows.mask.sum((0, 1))))  # [D]
    kl_sums, acc_sums = by_position(kl0, kl_mask), by_position(acc0, acc_mask)
    means = kl_sums / counts.clamp(min=1)
    weights = gamma ** torch.arange(m + 1, device=dev, dtype=torch.float32)
    return LossTerms(
        loss=(weights * means).sum(),
        kl_per_position=means.detach(),
        accuracy_per_position=(acc_sums.float() / counts.clamp(min=1)).detach(),
        count_per_position=counts.detach(),
    )


def count_token_frequencies(token_docs, vocab_size: int) -> torch.Tensor:
    """Occurrences of every target id over an iterable of token-id sequences -> [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for doc in token_docs:
        ids = torch.as_tensor(doc, dtype=torch.long)
        if ids.numel():
            counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def most_frequent_ids(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids (ties by lower id), always including `always` (e.g. EOS)."""
    if size > counts.numel():
        raise ValueError(f"draft_vocab_size {size} exceeds the target vocabulary ({counts.numel()})")
    forced = sorted({int(t) for t in always if 0 <= int(t) < counts.numel()})
    if len(forced) > size:
        raise ValueError(f"{len(forced)} forced ids do not fit a draft vocabulary of {size}")
    score = counts.double().clone()
    score[forced] = float("inf")
    # Stable sort on -score keeps lower ids first among ties.
    order = torch.sort(-score, stable=True).indices
    return order[:size].sort().values
