"""A measured cost model that sizes every round's draft trees (`decoding.sizing: auto`).

Speculation pays only when the tokens a tree adds are worth the time its rows cost, and both
sides differ by machine, dtype, batch and text: a verify forward over 17 rows costs about one
decoding step on a GPU or a CPU with matrix units but several on a CPU without them, and a draft
head that is right half the time on one prompt is useless on the next. So nothing here is a
constant; every round the engine's policy (`policy`) asks, one job per module:

- `latency`: seconds of one verify forward carrying R rows, a curve measured at start-up over a
  grid of R and refined online from every round it runs;
- `verify_costs`: one such curve per live batch size and logits path, and the rows and
  sequences a forward really runs (bucketed or packed shapes);
- `acceptance`: the probability that a draft node ends up on the accepted path, the product
  along its path of each step's calibrated rate (by the drafter's score of that step, which
  drafter proposed it and the temperature band), and each row's own record against it;
- `bias`: what both sides are off by on the rounds the sizer chose trees for;
- `drain`: what tokens are worth when the batch ends with its longest row;
- `sizer`: from those, the tree size N that maximises expected committed tokens per second for
  the whole batch, 0 included (a plain decoding step): `TreeSizer`, the `auto` policy;
- `pacing`: whether the drafter's model (the draft head) and drafting itself run this round,
  with back-offs while they do not pay.

Expected accepted tokens of a tree = the sum over its nodes of P(node on the accepted path)
(linearity of expectation), which holds for greedy and sampled verification alike.
"""
