"""Oracle sanity tier: the harness in dlrm.py against torchrec's own pipelines.

If these pass, ``plain_loop`` and torchrec 1.8.0's ``TrainPipelineBase`` /
``TrainPipelineSparseDist`` are bit-identical on this model, for every
sharding type that runs on CPU, so either can serve as the oracle for our
replacements in other test files.

Observed torchrec 1.8.0 behaviour on CPU + gloo (each backed by a test below):

* TrainPipelineBase runs fine on CPU: with no CUDA device its memcpy stream is
  None and ``torch.cuda.stream(None)`` is a no-op, so it is a plain loop that
  fetches batch i+1 before running batch i.  At end of data it raises
  StopIteration after exactly N steps (N=0 included).  It then stays stopped:
  a new iterator passed to ``progress`` is ignored (StopIteration at once)
  until ``reset()`` is called.
* TrainPipelineSparseDist runs on CPU (no streams; input_dist of batch i+1 is
  started before forward i and waited on after it).  With the default
  ``execute_all_batches=True`` it runs all N batches (N=0,1,2 included).  With
  ``execute_all_batches=False`` it stops after N-2 steps, dropping the two
  batches already in flight.  After StopIteration, handing it a new iterator
  just carries on (no reset needed), and two "epochs" equal one plain loop
  over the concatenated data.
* A 0-dim loss is fine: both pipelines do ``torch.sum(losses, dim=0)``, and
  dim=0 is a valid dim for a 0-dim tensor (it returns the scalar itself).
* data_parallel: the sharded EBC is still a pipelined module (its input_dist
  is trivial); the replicated tables use the "dense" kernel, which ignores the
  in-backward optimizer, so they are trained by the dense optimizer.
* The FX rewrite handles the nested batch: ``batch.features["sparse"]`` is
  traced as getattr + getitem and the EBC is pipelined (checked, not assumed).
* A sharded EBC's output KeyedTensor lists keys in shard-placement order (e.g.
  f2, f3, f0, f1 for table_wise on 2 ranks), not table order, so the model
  concatenates pooled embeddings by feature name.
* TrainPipelineSemiSync cannot run on CPU: it calls ``batch.record_stream``
  with a CPU stream, which ``Tensor.record_stream`` (and torchrec's KJT)
  reject with "unknown parameter type".  Not tested here.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import (
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    BATCH_SIZE,
    DENSE_LR,
    DLRM,
    EMB_LR,
    FEATURES,
    SHARDING_TYPES,
    Batch,
    NestedDLRM,
    Run,
    assert_runs_equal,
    current_group,
    make_batches,
    make_sharded,
    plain_loop,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED = 1234
DATA_SEED = 7
PIPELINES = [TrainPipelineBase, TrainPipelineSparseDist]


def _reference_state(model_factory, seed):
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in model_factory().state_dict().items()}


def _replicated_keys_agree_across_ranks(w):
    """Entries without a shard suffix are replicated: every rank must hold the
    same values.  Returns the keys that differ."""
    bad = []
    for key in sorted(k for k in w if "@" not in k):
        group = current_group()
        gathered = [torch.empty_like(w[key]) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, w[key].contiguous(), group=group)
        if not all(torch.equal(gathered[0], g) for g in gathered[1:]):
            bad.append(key)
    return bad


def test_process_group_backend_is_the_device_s():
    assert dist.is_initialized()
    assert dist.get_backend() == devices.backend()  # gloo on CPU, nccl on CUDA
    assert dist.get_world_size() >= 2


def test_batches_are_deterministic_and_rank_dependent():
    a, b = make_batches(3, seed=DATA_SEED), make_batches(3, seed=DATA_SEED)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.dense, y.dense)
        assert torch.equal(x.sparse.values(), y.sparse.values())
        assert torch.equal(x.sparse.lengths(), y.sparse.lengths())
    lengths = torch.cat([x.sparse.lengths() for x in a])
    assert (lengths == 0).any() and (lengths > 1).any()  # empty and multi-id bags
    # ranks see different data
    other_rank = (dist.get_rank() + 1) % dist.get_world_size()
    other = make_batches(1, seed=DATA_SEED, rank=other_rank)[0]
    assert not torch.equal(other.dense, a[0].dense)
    nested = make_batches(3, seed=DATA_SEED, nested=True)
    assert torch.equal(nested[2].features["sparse"].values(), a[2].sparse.values())


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_builds_with_same_seed_start_identical(sharding_type):
    builds = [weights(make_sharded(DLRM, sharding_type, seed=SEED)[0]) for _ in range(3)]
    for i, w in enumerate(builds[1:], start=1):
        assert w.keys() == builds[0].keys(), f"build {i}: different state keys"
        for key in w:
            assert torch.equal(w[key], builds[0][key]), f"build {i}: {key} differs"
    # ... and they hold the unsharded model's weights, sliced per shard
    ref = _reference_state(DLRM, SEED)
    for key, t in builds[0].items():
        name, _, offs = key.partition("@")
        if offs:
            starts = [int(o) for o in offs.split(",")]
            idx = tuple(slice(s, s + n) for s, n in zip(starts, t.shape, strict=True))
            assert torch.equal(t, ref[name][idx]), key
        else:
            assert torch.equal(t, ref[name]), key
    # a different seed really gives different weights
    other = weights(make_sharded(DLRM, sharding_type, seed=SEED + 1)[0])
    assert any(not torch.equal(other[k], builds[0][k]) for k in other)


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_sharded_forward_matches_unsharded_model(sharding_type):
    """Same logical weights, whatever the plan: step-0 predictions of every
    sharding type agree with the unsharded model (to fp rounding)."""
    batch = make_batches(1, seed=DATA_SEED)[0]
    torch.manual_seed(SEED)
    unsharded = DLRM()
    dmp, _ = make_sharded(DLRM, sharding_type, seed=SEED)
    with torch.no_grad():
        want = unsharded(batch)[1]
        got = dmp(batch)[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _global_batch(per_rank):
    """Concatenate one batch from every rank into the batch an unsharded model
    would see; rank r's samples are rows [r*B, (r+1)*B)."""
    values, lengths = [], []
    for f in FEATURES:
        for b in per_rank:
            jt = b.sparse[f]
            values.append(jt.values())
            lengths.append(jt.lengths())
    return Batch(
        dense=torch.cat([b.dense for b in per_rank]),
        sparse=KeyedJaggedTensor.from_lengths_sync(
            keys=list(FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)
        ),
        labels=torch.cat([b.labels for b in per_rank]),
    )


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_sharded_training_matches_unsharded_global_batch(sharding_type):
    """The sharded model trains like one unsharded model on the global batch.

    Uses SGD for the fused embedding optimizer: fbgemm's fused Adagrad is not
    numerically torch.optim.Adagrad (drifts ~1e-3 in a few steps), SGD is.
    data_parallel tables are dense params (see make_sharded), so there the
    reference trains everything with the dense Adagrad.
    """
    world, rank, n = dist.get_world_size(), dist.get_rank(), 4
    per_rank = [make_batches(n, seed=DATA_SEED, rank=r) for r in range(world)]
    dmp, opt = make_sharded(DLRM, sharding_type, seed=SEED, emb_optimizer=torch.optim.SGD)
    run = plain_loop(dmp, opt, per_rank[rank])

    torch.manual_seed(SEED)
    ref = DLRM()
    is_emb = lambda name: name.startswith("ebc.")  # noqa: E731
    emb = [p for name, p in ref.named_parameters() if is_emb(name)]
    dense = [p for name, p in ref.named_parameters() if not is_emb(name)]
    if sharding_type == "data_parallel":
        opts = [torch.optim.Adagrad(dense + emb, lr=DENSE_LR)]
    else:
        opts = [torch.optim.Adagrad(dense, lr=DENSE_LR), torch.optim.SGD(emb, lr=EMB_LR)]
    for step in range(n):
        for o in opts:
            o.zero_grad()
        loss, pred = ref(_global_batch([per_rank[r][step] for r in range(world)]))
        loss.backward()
        for o in opts:
            o.step()
        mine = pred[rank * BATCH_SIZE : (rank + 1) * BATCH_SIZE]
        torch.testing.assert_close(run[step], mine, rtol=1e-5, atol=1e-6, msg=f"step {step}")


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_plain_loop_trains_everything_and_replicas_agree(sharding_type):
    dmp, opt = make_sharded(DLRM, sharding_type, seed=SEED)
    before = weights(dmp)
    run = plain_loop(dmp, opt, make_batches(4, seed=DATA_SEED))
    assert len(run) == 4 and all(o.shape == (16,) for o in run)
    unchanged = [k for k in before if torch.equal(before[k], run.weights[k])]
    assert not unchanged, f"not trained: {unchanged}"
    assert not _replicated_keys_agree_across_ranks(run.weights)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
@pytest.mark.parametrize("pipeline_cls", PIPELINES, ids=lambda c: c.__name__)
def test_torchrec_pipeline_matches_plain_loop(pipeline_cls, sharding_type, nested):
    factory = NestedDLRM if nested else DLRM
    batches = make_batches(seed=DATA_SEED, nested=nested)

    ref = plain_loop_of(factory, sharding_type, batches, seed=SEED)

    dmp, opt = make_sharded(factory, sharding_type, seed=SEED)
    pipeline = pipeline_cls(dmp, opt, DEVICE)
    got = run_pipeline(pipeline, batches)

    assert_runs_equal(ref, got, ("plain_loop", pipeline_cls.__name__))
    if pipeline_cls is TrainPipelineSparseDist:
        # the comparison only means something if the EBC really was pipelined
        # (torchrec silently falls back to an ordinary forward otherwise)
        assert [type(m).__name__ for m in pipeline._pipelined_modules] == [
            "ShardedEmbeddingBagCollection"
        ]


@pytest.mark.parametrize("pipeline_cls", PIPELINES, ids=lambda c: c.__name__)
def test_torchrec_pipeline_per_sample_loss(pipeline_cls):
    """A [B] loss works too (the pipelines sum it over dim 0 before backward)."""
    factory = functools.partial(DLRM, per_sample_loss=True)
    batches = make_batches(4, seed=DATA_SEED)
    ref = plain_loop(*make_sharded(factory, "table_wise", seed=SEED), batches)
    got = run_pipeline(
        pipeline_cls(*make_sharded(factory, "table_wise", seed=SEED), DEVICE), batches
    )
    assert_runs_equal(ref, got)
    mean_loss = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
    assert not torch.equal(ref[1], mean_loss[1])  # the loss scale really differs


# ---------------------------------------------------------------------------
# The comparison has teeth
# ---------------------------------------------------------------------------


def test_assert_runs_equal_catches_differences():
    batches = make_batches(4, seed=DATA_SEED)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
    assert_runs_equal(ref, plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches))

    # batches out of order: first difference at step 2
    swapped = batches[:2] + [batches[3], batches[2]]
    run = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), swapped)
    with pytest.raises(AssertionError, match="step 2"):
        assert_runs_equal(ref, run)

    # one step short
    run = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches[:3])
    with pytest.raises(AssertionError, match="ran 4 steps"):
        assert_runs_equal(ref, run)

    # same outputs, but the last update never happened
    dmp, opt = make_sharded(DLRM, "table_wise", seed=SEED)
    outs = plain_loop(dmp, opt, batches[:3])
    with torch.no_grad():
        outs.append(dmp(batches[3])[1])
    with pytest.raises(AssertionError, match="final weights"):
        assert_runs_equal(ref, Run(outs, weights(dmp)))


def test_embedding_updates_show_in_predictions():
    """A pipeline that looked up embeddings before the previous step's update
    would differ from step 1 on: check that embedding updates are visible
    there, by freezing the (fused-optimizer) embeddings instead."""
    batches = make_batches(3, seed=DATA_SEED)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
    frozen = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED, emb_lr=0.0), batches)
    assert torch.equal(ref[0], frozen[0])
    assert (ref[1] - frozen[1]).abs().max() > 1e-3


# ---------------------------------------------------------------------------
# torchrec's end-of-data behaviour (what a drop-in replacement must match)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2])
@pytest.mark.parametrize("pipeline_cls", PIPELINES, ids=lambda c: c.__name__)
def test_torchrec_short_data(pipeline_cls, n):
    batches = make_batches(n, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    pipeline = pipeline_cls(*make_sharded(DLRM, "table_wise", seed=SEED), DEVICE)
    got = run_pipeline(pipeline, batches)
    assert_runs_equal(ref, got)
    with pytest.raises(StopIteration):  # and keeps saying so
        pipeline.progress(iter([]))


def test_torchrec_sparse_dist_without_execute_all_batches_drops_two():
    batches = make_batches(seed=DATA_SEED)
    pipeline = TrainPipelineSparseDist(
        *make_sharded(DLRM, "table_wise", seed=SEED), DEVICE, execute_all_batches=False
    )
    got = run_pipeline(pipeline, batches)
    assert len(got) == len(batches) - 2
    ref = plain_loop_of(DLRM, "table_wise", batches[:-2], seed=SEED)
    assert_runs_equal(ref, got)


def test_torchrec_second_iterator():
    batches = make_batches(6, seed=DATA_SEED)
    first, second = batches[:3], batches[3:]

    base = TrainPipelineBase(*make_sharded(DLRM, "table_wise", seed=SEED), DEVICE)
    assert len(run_pipeline(base, first)) == 3
    assert len(run_pipeline(base, second)) == 0  # ignored until reset()
    base.reset()
    assert len(run_pipeline(base, second)) == 3

    sdd = TrainPipelineSparseDist(*make_sharded(DLRM, "table_wise", seed=SEED), DEVICE)
    a = run_pipeline(sdd, first)
    b = run_pipeline(sdd, second)  # carries on without reset()
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    assert_runs_equal(ref, Run(list(a) + list(b), b.weights))
