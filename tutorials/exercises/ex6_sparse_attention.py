"""Exercise 6: a draft token's sparse attention over the selected positions, with GQA.

A draft token does not attend to its whole context. For every KV head, the last verification chose a few positions
(exercise 3), and the query heads of that KV head's group attend to those positions only, as if the rest of the
context were not there. The package copies the selected keys and values into per-request draft buffers once per
selection (`attention.fill_draft_buffers`) and attends there (`attention.sparse_attention`); here you do both halves
for one token of one layer: fetch each KV head's selected keys and values, then attend.

With grouped-query attention (GQA) the n_heads query heads share n_kv KV heads, G = n_heads / n_kv query heads each.
Query heads are numbered group by group: the first G of them read KV head 0, the next G read KV head 1, and so on.

Check your answer: python -m tutorials.check 6
(reference: nano_sparsespec.attention.sparse_attention over the gathered keys and values)
"""
import torch


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """The attention output of one draft token, each query head over its KV head's selected positions.

    q         Float[n_heads, D]  the token's query, one vector per query head
    k, v      Float[L, n_kv, D]  the layer's keys and values of the request's L cached positions
    selected  Long[n_kv, B]      for each KV head, the B distinct positions (in no particular order) its group reads
    returns Float[n_heads, D]: for each query head, ordinary scaled dot-product (softmax) attention of its query over
      its KV head's keys at that head's selected positions, averaging the values at the same positions. A position
      that is not selected for a KV head has no influence at all on the outputs of that head's group.
    """
    raise NotImplementedError("exercise 6: write attend_selected")
