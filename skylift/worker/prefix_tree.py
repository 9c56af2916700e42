"""Prefix sharing: a micro-batch as one packed row in which every distinct prefix is computed once.

A GRPO micro-batch repeats a lot of tokens: the samples of a prompt share that prompt, the prompts
of a dataset often share a system message and worked examples, and identical samples share
everything. Here the micro-batch's sequences (each row's real prompt + response tokens) are
inserted into a token trie; the packed row holds one token per trie node, in the order the nodes
were created (a parent always comes before its children), with position id = the token's index in
its sequence. A 4D attention mask lets a token attend to itself and its ancestors only: exactly
the tokens its own sequence's causal attention sees, so every logit equals the padded pass's (sdpa
and eager attention; flash-attention kernels take no such mask). Response tokens are scored at the
node of the token before them; a node's logits are computed once however many rows share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from skylift.algorithms.sample_support import Sampling, logprobs_with_full, token_logprobs
from skylift.worker.batch import SequenceBatch
from skylift.worker.vision_inputs import with_sampling_bias

#: Attention implementations that take a dense 4D mask (flash-attention kernels do not).
TREE_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class PrefixTree:
    """The trie of a micro-batch's sequences and where its response tokens are scored."""

    input_ids: Tensor  # [1, N] one token per distinct prefix
    position_ids: Tensor  # [1, N] the token's index in its sequence (its depth in the trie)
    parents: Tensor  # [N] the node before it in its sequences (-1 for a first token)
    keep: Tensor  # [K] distinct nodes whose outputs score some response token
    index: Tensor  # [M] for each scored response token, its node's place in `keep`
    rows: Tensor  # [M] the response token's row in the micro-batch
    cols: Tensor  # [M] its response column
    targets: Tensor  # [M] the response token

    @property
    def num_nodes(self) -> int:
        return int(self.input_ids.shape[1])

    def ancestor_mask(self) -> Tensor:
        """`[N, N]` bool: node i sees node j when j is i or one of its ancestors."""
        n = self.num_nodes
        mask = torch.zeros(n, n, dtype=torch.bool)
        for node, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                mask[node] = mask[parent]
            mask[node, node] = True
        return mask


def build_prefix_tree(micro: SequenceBatch) -> PrefixTree:
    """The trie of `micro` (see the module docstring). A row's real tokens are contiguous (prompt
    left-padded to P, response right-padded) and every prompt has at least one token."""
    real = micro.attention_mask.bool()
    prompt_lens = real[:, : micro.prompt_len].sum(-1).tolist()
    response_lens = real[:, micro.prompt_len :].sum(-1).tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    children: dict[tuple[int, int], int] = {}
    scoring: list[int] = []  # per scored response token, the node that predicts it
    rows: list[int] = []
    cols: list[int] = []
    for row, (ids, mask) in enumerate(zip(micro.input_ids.tolist(), real.tolist(), strict=True)):
        if prompt_lens[row] < 1:
            raise ValueError(f"row {row} has an empty prompt: nothing predicts its first response token")
        node = -1
        path: list[int] = []
        for depth, token in enumerate(t for t, m in zip(ids, mask, strict=True) if m):
            child = children.get((node, token))
            if child is None:
                child = children[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                depths.append(depth)
            path.append(child)
            node = child
        for col in range(response_lens[row]):
            scoring.append(path[prompt_lens[row] - 1 + col])
            rows.append(row)
            cols.append(col)
    keep, index = torch.unique(torch.tensor(scoring, dtype=torch.long), return_inverse=True)
    rows_t = torch.tensor(rows, dtype=torch.long)
    cols_t = torch.tensor(cols, dtype=torch.long)
    return PrefixTree(
        input_ids=torch.tensor([tokens], dtype=torch.long),
        position_ids=torch.tensor([depths], dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        keep=keep,
        index=index,
        rows=rows_t,
        cols=cols_t,
        targets=micro.response_ids[rows_t, cols_t].cpu(),
    )


def _attention_mask(model: torch.nn.Module, tree: PrefixTree, device: torch.device) -> Tensor:
    """The tree's 4D mask in the form the model's attention implementation adds or applies."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if implementation not in TREE_ATTENTION:
        raise ValueError(
            f"prefix sharing needs one of the attention implementations {TREE_ATTENTION} (a dense "
            f"tree mask), this model uses {implementation!r}; set trainer.share_prefixes=false"
        )
    visible = tree.ancestor_mask().to(device)[None, None]
    if implementation == "sdpa":
        return visible
    dtype = next(model.parameters()).dtype
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
        ~visible, torch.finfo(dtype).min
    )


def _forward(model: torch.nn.Module, tree: PrefixTree, device: torch.device, **kwargs: object) -> Tensor:
    out = model(
        input_ids=tree.input_ids.to(device),
        position_ids=tree.position_ids.to(device),
        attention_mask=_attention_mask(model, tree, device),
        use_cache=False,
        **kwargs,
    )
    return out.logits[0]


def _scatter(micro: SequenceBatch, tree: PrefixTree, flat: Tensor) -> Tensor:
    shape = (micro.batch_size, micro.response_len, *flat.shape[1:])
    out = torch.zeros(shape, dtype=flat.dtype, device=flat.device)
    return out.index_put((tree.rows.to(flat.device), tree.cols.to(flat.device)), flat)


def prefix_tree_response_logprobs(
    model: torch.nn.Module, micro: SequenceBatch, temperature: Sampling = 1.0, with_full: bool = False
) -> Tensor:
    """Logprobs `[b, R]` of `micro.response_ids` (zeros at padding), from one prefix-shared forward
    (`temperature` and `with_full` as in `skylift.worker.logprobs.response_logprobs`)."""
    device = micro.input_ids.device
    tree = build_prefix_tree(micro)
    logits = with_sampling_bias(model, _forward(model, tree, device, logits_to_keep=tree.keep.to(device)))
    score = logprobs_with_full if with_full else token_logprobs
    return _scatter(micro, tree, score(logits, tree.targets.to(device), temperature, tree.index.to(device)))


def prefix_tree_response_values(model: torch.nn.Module, micro: SequenceBatch) -> Tensor:
    """A value model's estimate per response token `[b, R]` (zeros at padding), read at the nodes
    `prefix_tree_response_logprobs` scores, from one prefix-shared forward."""
    device = micro.input_ids.device
    tree = build_prefix_tree(micro)
    values = _forward(model, tree, device)[:, 0].float()
    return _scatter(micro, tree, values[tree.keep.to(device)][tree.index.to(device)])


__all__ = [
    "TREE_ATTENTION",
    "PrefixTree",
    "build_prefix_tree",
    "prefix_tree_response_logprobs",
    "prefix_tree_response_values",
]
