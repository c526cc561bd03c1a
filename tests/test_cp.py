"""Context-parallel evaluation: sharding, guards, and eval losses under CP equal to one process without CP."""
import pytest
import torch
from fsdp_kit.cp import (CPSpec, cp_eval_worker, shard_sequence, unshard_sequence, nearest_lengths, check_seq_len, check_sizes,
                         check_rotate, check_mask, eval_batch, shift_labels)
from fsdp_kit.errors import KitError
from fsdp_kit.launch import launch
from fsdp_kit.mesh import MeshSpec
from tests.conftest import EXAMPLES
from tests.badinput import refused

pytestmark = pytest.mark.timeout(240)
CP2 = dict(mesh=MeshSpec(cp=2), seq_len=128, steps=1)  # the CP lab's evaluation: 2 CP ranks, 128-token sequences, one forward


def test_shard_sequence_is_head_tail_and_round_trips():
    x = torch.arange(16)[None]
    assert shard_sequence(x, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(x, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    for cp in (1, 2, 4):
        shards = [shard_sequence(x, cp, r) for r in range(cp)]
        assert {s.shape[1] for s in shards} == {16 // cp}
        assert torch.equal(unshard_sequence(shards) if cp > 1 else shards[0], x)


def test_labels_shifted_before_the_split():
    tokens, labels = eval_batch(256, 4, 32)
    assert (labels == -100).any() and (labels != -100).any()
    shifted = shift_labels(labels)
    assert torch.equal(shifted[:, :-1], labels[:, 1:]) and (shifted[:, -1] == -100).all()


def test_guards():
    assert nearest_lengths(130, 2) == [128, 132] and nearest_lengths(100, 4) == [96, 104]
    with pytest.raises(KitError, match=r"seq_len=130 .* 2 x cp_size = 4.*128 and 132"): check_seq_len(130, 2)
    with pytest.raises(KitError, match=r"rotate_method='ring'.*'allgather' or 'alltoall'"): check_rotate("ring")
    with pytest.raises(KitError, match=r"attention_mask='padding'.*'causal' or None"): check_mask("padding")
    with pytest.raises(KitError, match=r"cp_size=3 .*divisor of the world size 4: one of 1, 2, 4"): check_sizes(4, cp=3)
    with pytest.raises(KitError, match=r"cp_size=2 and sp_size=2 cannot both be above 1"): check_sizes(4, cp=2, sp=2)
    with pytest.raises(KitError, match=r"steps=3 is not allowed: 1 \(what CPSpec runs\)"): CPSpec(mesh=MeshSpec(cp=2), steps=3).check(4)
    assert CPSpec(**CP2, batch=3).rows(4) == 6  # batch is per data-parallel rank: dp_shard=2 of them
    assert check_sizes(4, cp=2).dp_shard == 2 and CPSpec(mesh=MeshSpec(cp=4), seq_len=64, steps=1).check(4).mesh.cp == 4


@pytest.mark.parametrize("args, message", [
    (["--nproc", "2", "--cp", "2", "--sp", "2"], "--cp=2 and --sp=2 cannot both be above 1"),
    (["--nproc", "2", "--cp", "2", "--seq-len", "130"], "nearest lengths that work are 128 and 132"),
    (["--nproc", "2", "--cp", "2", "--mask", "padding"], "attention_mask='padding' is not allowed"),
    (["--nproc", "2", "--cp", "2", "--rotate", "ring"], "'allgather' or 'alltoall'"),
    (["--nproc", "4", "--cp", "3"], "--cp=3 is not allowed: a divisor of the world size 4: one of 1, 2, 4"),
])
def test_cli_guards(tmp_path, args, message):
    refused(["cp-eval", *args], message, tmp_path)


def _check(r, cp, rotate):
    assert (r.cp_size, r.rotate_method) == (cp, rotate)
    assert abs(r.eval_loss - r.eval_loss_reference) <= 1e-5, (r.eval_loss, r.eval_loss_reference)
    assert r.predictions_match_reference is True and r.max_logit_diff < 1e-4
    assert r.tokens == sum(r.tokens_per_rank) and r.tokens < r.rows * (r.seq_len - 1)  # -100 labels present
    assert all(b > 0 for b in r.peak_bytes)


def test_padding_mask_refused_by_the_model():
    from fsdp_kit.cp import use_cp_attention
    from fsdp_kit.models import build_model, model_config, synthetic_tokens
    model = use_cp_attention(build_model(model_config("tiny"))).eval()
    ids = synthetic_tokens(256, 2, 32)
    padding = torch.ones_like(ids); padding[:, -4:] = 0
    with pytest.raises(KitError, match=r"attention_mask='a padding mask with 8 masked positions'.*labels of -100"):
        model(input_ids=ids, attention_mask=padding)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, model(input_ids=ids).logits)


def test_cp2_and_dp2_cp2_agree_with_one_process():
    "2-way CP (both rotations) and 2 x 2 (dp_shard x cp) give one process's loss (each run's own no-CP reference) over the same tokens."
    # batch per data-parallel rank: the same 4 rows
    dp2cp2 = CPSpec(**CP2 | dict(mesh=MeshSpec(dp_shard=2, cp=2)), batch=2, rotate="alltoall")
    out = {"cp2": launch(cp_eval_worker, CPSpec(**CP2), nprocs=2), "ring": launch(cp_eval_worker, CPSpec(**CP2, rotate="alltoall"),
                                                                              nprocs=2),
           "dp2cp2": launch(cp_eval_worker, dp2cp2, nprocs=4)}
    for name, rotate in (("cp2", "allgather"), ("ring", "alltoall"), ("dp2cp2", "alltoall")):
        _check(out[name], 2, rotate)  # eval_loss within 1e-5 of eval_loss_reference, the model in one process without CP
    assert out["dp2cp2"].groups["dp_shard_cp"] == [0, 1, 2, 3] and out["dp2cp2"].dp_shard == 2
    assert len(set(out["dp2cp2"].tokens_per_rank)) > 1  # ranks hold different numbers of valid tokens
    assert out["cp2"].tokens == out["ring"].tokens == out["dp2cp2"].tokens
    assert abs(out["cp2"].eval_loss_reference - out["dp2cp2"].eval_loss_reference) <= 1e-6  # the same weights and rows, whatever the layout
    ring = out["ring"]
    # the usual mistake is further off
    assert abs(ring.mean_of_rank_means - ring.eval_loss) > abs(ring.eval_loss - ring.eval_loss_reference)


def test_qwen2_gqa_and_no_mask():
    for rotate in ("allgather", "alltoall"):
        r = launch(cp_eval_worker, CPSpec(str(EXAMPLES / "qwen2-tiny" / "config.json"), **CP2, rotate=rotate), nprocs=2)
        _check(r, 2, rotate)
    full = launch(cp_eval_worker, CPSpec(**CP2, rotate="alltoall", mask=None), nprocs=2)
    _check(full, 2, "alltoall")
