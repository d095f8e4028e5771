"""Tree drafts: the target's tree attention, tree verification, the EAGLE-2 dynamic tree.

1. One target pass over a tree gives every node the logits a causal pass over its own
   root-to-node path gives (tree mask + depth positions), on both static-session targets.
2. Greedy tree verification follows the target's argmax down the tree.
3. An oracle tree proposer whose right branch sits at non-prefix indices: outputs equal
   target-only greedy, so the accepted path is compacted correctly in the target's cache.
4. The EAGLE-2 proposer: with top_k=1 it is the chain; with top_k>1 every expanded node's
   children are the drafter's top-k when stepped along that node's own path.
"""

import pytest
import torch

from inference import engine
from inference.draft import Draft
from inference.drafting import ChainProposer, DraftingConfig, DynamicTreeProposer
from inference.engine import generate, verify_tree_greedy
from inference.sessions import open_session

TREE = Draft(tokens=[5, 6, 7, 8, 9, 10], parents=[-1, -1, 0, 0, 1, 3])  # depths 1 1 2 2 2 3


def path_to(draft: Draft, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = draft.parents[node]
    return path[::-1]


def test_draft_depths_and_mask():
    assert TREE.depths() == [1, 1, 2, 2, 2, 3]
    mask = TREE.tree_mask()
    for node in range(len(TREE.tokens)):
        seen = {0} | {n + 1 for n in path_to(TREE, node)}
        assert {j for j in range(7) if mask[node + 1, j]} == seen
    assert Draft.chain([1, 2, 3]).is_chain and not TREE.is_chain


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_pass_equals_a_causal_pass_per_path(target_dirs, family, text_batch):
    from conftest import load_target

    target = load_target(target_dirs, family)
    prompt = text_batch[0, :10].tolist()
    tree = Draft(tokens=text_batch[1, :6].tolist(), parents=TREE.parents)
    session = open_session(target, 64)
    session(torch.tensor([prompt[:-1]]))
    out = session(torch.tensor([[prompt[-1], *tree.tokens]]), tree=tree.tree_mask(),
                  depths=torch.tensor([0, *tree.depths()]))
    for node in range(len(tree.tokens)):
        chain = open_session(target, 64)
        chain(torch.tensor([prompt[:-1]]))
        reference = chain(torch.tensor([[prompt[-1], *[tree.tokens[n] for n in path_to(tree, node)]]]))
        torch.testing.assert_close(out.logits[0, node + 1], reference.logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.aux_hidden[0][0, node + 1], reference.aux_hidden[0][0, -1], atol=1e-5, rtol=1e-5)


def test_verify_tree_greedy_follows_the_argmax():
    V = 16
    logits = torch.zeros(7, V)

    def argmax_at(row, token):
        logits[row, token] = 1.0

    argmax_at(0, 6)  # root -> node 1 (token 6)
    argmax_at(2, 9)  # node 1 -> node 4 (token 9)
    argmax_at(5, 3)  # node 4 has no children: bonus 3
    assert verify_tree_greedy(TREE, logits) == ([1, 4], 3)
    logits.zero_()
    argmax_at(0, 11)  # no root child is 11: nothing accepted, bonus 11
    assert verify_tree_greedy(TREE, logits) == ([], 11)


class OracleTree:
    """Knows the target's greedy continuation; each round proposes a 3-deep tree whose right
    branch is preceded by a wrong sibling at every depth, and is cut short every other round."""

    def __init__(self, reference: list[int]):
        self.reference, self.rounds, self.accepted = reference, 0, []

    def prefill(self, prompt, token, target_out):
        self.seq = list(prompt) + [token]

    def accept(self, new_tokens, target_out):
        assert target_out.logits.shape[1] == len(new_tokens)
        self.seq += new_tokens

    def propose(self, temperature, generator):
        right = self.reference[len(self.seq):len(self.seq) + 3]
        right += [0] * (3 - len(right))
        depth_right = 3 if self.rounds % 2 == 0 else 1
        self.rounds += 1
        tokens, parents, parent = [], [], -1
        for d in range(3):
            good = right[d] if d < depth_right else (right[d] + 1) % 320
            tokens += [(right[d] + 2) % 320, good]  # the wrong sibling first: the right path is not a prefix
            parents += [parent, parent]
            parent = len(tokens) - 1
        return Draft(tokens, parents)


def test_tree_generation_matches_target_only(llama_target, text_batch, monkeypatch):
    prompt = text_batch[0, :12].tolist()
    reference = generate(llama_target, None, prompt, 30, k=0).tokens
    oracle = OracleTree(prompt + reference)
    monkeypatch.setattr(engine, "make_proposer", lambda *args: oracle)
    out = generate(llama_target, object(), prompt, 30, k=3, drafting=DraftingConfig(mode="tree"))
    assert out.tokens == reference
    assert out.stats.num_accepted_tokens > out.stats.num_drafts  # whole branches were accepted


def test_tree_mode_refuses_sampling(llama_target, make_drafter, text_batch):
    from common.config import UserError

    with pytest.raises(UserError, match="greedily"):
        generate(llama_target, make_drafter(llama_target), text_batch[0, :8].tolist(), 8, k=3, temperature=0.7,
                 drafting=DraftingConfig(mode="tree"))


def prefilled(proposer_class, drafter, target, prompt, **drafting):
    session = open_session(target, 128)
    out = session(torch.tensor([prompt]))
    proposer = proposer_class(drafter, 4, target.vocab_size, 128, DraftingConfig(mode="tree", **drafting))
    proposer.prefill(prompt, int(out.logits[0, -1].argmax()), out)
    return proposer


def test_dynamic_tree_with_top_k_1_is_the_chain(target, make_drafter, text_batch):
    drafter, prompt = make_drafter(target).eval(), text_batch[0, :12].tolist()
    generator = torch.Generator()
    chain = prefilled(ChainProposer, drafter, target, prompt).propose(0.0, generator)
    tree = prefilled(DynamicTreeProposer, drafter, target, prompt, tree_top_k=1, tree_total_tokens=4)
    assert tree.propose(0.0, generator) == chain


def test_dynamic_tree_children_are_the_top_k_along_their_path(target, make_drafter, text_batch):
    drafter, prompt = make_drafter(target).eval(), text_batch[0, :12].tolist()
    top_k = 3
    proposer = prefilled(DynamicTreeProposer, drafter, target, prompt, tree_top_k=top_k, tree_total_tokens=10_000)
    verified = proposer.cache.length
    tree = proposer.propose(0.0, torch.Generator())
    assert proposer.cache.length == verified
    assert len(tree.tokens) == top_k + 3 * top_k * top_k  # nothing dropped by reranking at this size
    for node in [-1, *range(len(tree.tokens))]:
        children = [tree.tokens[c] for c, p in enumerate(tree.parents) if p == node]
        if not children:
            continue
        logits, hidden = proposer.logits[:, -1:], proposer.hidden[:, -1:]
        for n in path_to(tree, node) if node >= 0 else []:
            logits, hidden = drafter.step(proposer.cache, torch.tensor([[tree.tokens[n]]]), hidden)
        proposer.cache.crop(verified)
        expected = drafter.draft_to_target[logits[0, -1].topk(top_k).indices].tolist()
        assert sorted(children) == sorted(expected), node
