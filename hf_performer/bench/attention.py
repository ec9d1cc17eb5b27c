"""Benchmarks of one attention layer: FAVOR+ against softmax, and FAVOR+ against its target.

* ``speed``: forward+backward time and peak memory of one attention call at head geometry
  ``[B, H, L, d]`` for FAVOR+ (bidirectional and causal) against
  ``torch.nn.functional.scaled_dot_product_attention`` and the eager materialised softmax that
  transformers' ``"eager"`` path uses, all measured in the same run, interleaved length by length.
  Reports the crossover length, achieved GFLOP/s and a plain matmul's GFLOP/s on the same machine.
  Bidirectional only, the zero-shot approximations of softmax: clustered and improved clustered attention
  (``--clusters``, ``--topk``) and a Reformer-style shared-QK LSH attention (:mod:`.lsh_attention`, a comparison
  row only).
  The sink + sliding-window hybrid (``window``: exact softmax over ``--sinks`` sink tokens and a ``--window``-token
  band, a learned Hedgehog tail of ``2 d`` features for everything older, learned softmax weight; bidirectional and
  causal) is timed against the same SDPA.
* ``approximation``: mean squared error of FAVOR+ attention against exact softmax attention as the
  number of random features grows, orthogonal against iid projections, over several seeds.

* ``forward speed``: inference forward time of a whole converted model against its softmax source (SDPA), length by
  length (``hf-performer quickstart``'s speed comparison).

The first two write a JSON (with machine, device and versions) and a PNG plot (:mod:`.report`). Run
``hf-performer bench --help``.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from ..clustered_attention import (
    DEFAULT_HASH_BITS,
    DEFAULT_ITERATIONS,
    clustered_attention,
    improved_clustered_attention,
)
from ..feature_maps import make_feature_map
from ..linear_attention import DEFAULT_CHUNK_SIZE, linear_attention
from ..reference import softmax_attention
from ..window_attention import window_linear_attention
from .defaults import (
    ATTENTION_IMPLEMENTATIONS,
    ATTENTION_MODES,
    BIDIRECTIONAL_ONLY,
    DEFAULT_ATTENTION_IMPLEMENTATIONS,
    DEFAULT_BUCKET_SIZE,
    DEFAULT_CLUSTERS,
    DEFAULT_SINKS,
    DEFAULT_SPARSE_CACHE,
    DEFAULT_TOPK,
    DEFAULT_WINDOW,
    runs_in_mode,
)
from .lsh_attention import lsh_attention
from .machine import (
    load_average,
    machine_info,
    matmul_gflops,
    median_of_fresh_processes,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
    run_in_fresh_process,
    timed_calls,
)
from .report import summarize_memory, summarize_speed

WINDOW_FEATURE_MAP = "hedgehog"  # the tail of the trained hybrids (LoLCATs): 2 d features, learned gamma
WINDOW_GAMMA = 0.1  # gamma's initial value (sigmoid(w) at w = logit(0.1)); its value does not change the cost


# ------------------------------------------------------------------------------------ FLOP counts


def attention_flops(implementation: str, mode: str, length: int, heads: int, head_dim: int, nb_features: int,
                    batch: int = 1, chunk_size: int = DEFAULT_CHUNK_SIZE, backward: bool = True,
                    clusters: int = DEFAULT_CLUSTERS, topk: int = DEFAULT_TOPK,
                    bucket_size: int = DEFAULT_BUCKET_SIZE, window: int = DEFAULT_WINDOW,
                    sinks: int = DEFAULT_SINKS) -> float:
    """Matmul FLOPs of one attention call as executed (forward, plus backward if asked).

    Softmax: ``4 L^2 d`` forward, ``10 L^2 d`` backward (flash-style, scores recomputed), halved
    when causal. FAVOR+ (``e = d + 1``, chunk ``C``; the backward recomputes the features of queries and
    keys chunk by chunk, the causal one twice, in its forward-order and reverse-order passes):
    bidirectional ``4 L m d + 4 L m e`` forward and ``8 L m d + 8 L m e`` backward; causal
    ``4 L m d + 2 L C (m + e) + 4 L m e`` forward and ``12 L m d + 6 L C (m + e) + 10 L m e`` backward (the
    backward reuses the saved output and denominators: no sums are recomputed). Clustered (``c`` clusters, ``b`` hash
    bits, ``t`` Lloyd iterations, no gradient): ``2 L d b + 2 (t + 1) L c b`` clustering, ``4 L c d`` attention
    forward and ``8 L c d`` backward; improved adds ``2 L c d`` (the rest) and ``4 L k d`` (``8 L k d``
    backward). LSH (bucket ``s``): ``2 L d (L / s) / 2`` hashing and ``8 L s d`` forward (``20 L s d`` backward).
    Window hybrid (window ``w``, ``s`` sinks, query block ``C``, Hedgehog tail ``m = 2 d``): per query block the
    exact tile over its ``C + w - 1`` band keys (``C + 2 w - 2`` bidirectional) and the sinks, ``4 L (C + w + s) d``
    (``4 L (C + 2 w + s) d``), the maps ``2 L d m`` (q and k: ``d x m/2`` each), the tail ``4 L m e``; backward
    counted as twice the forward (autograd through the chunked operator). Window + sparse cache, no tail
    (``window-cache``, ``G`` cache keys): the exact tile over ``C + w - 1 + s + G`` keys, ``4 L (C + w + s + G) d``;
    backward twice the forward.
    """
    L, d, m, C, e = length, head_dim, nb_features, chunk_size, head_dim + 1
    if implementation in ("clustered", "improved-clustered"):
        c, b, k = min(clusters, L), DEFAULT_HASH_BITS, topk
        forward = 2 * L * d * b + 2 * (DEFAULT_ITERATIONS + 1) * L * c * b + 4 * L * c * d
        backward_flops = 8 * L * c * d
        if implementation == "improved-clustered":
            forward += 2 * L * c * d + 4 * L * k * d
            backward_flops += 4 * L * c * d + 8 * L * k * d
    elif implementation == "lsh":
        s = min(bucket_size, L)
        forward, backward_flops = L * d * max(2, L // s) + 8 * L * s * d, 20 * L * s * d
    elif implementation == "window":
        band = C + (2 * window if mode == "bidirectional" else window) + sinks
        m = 2 * d
        forward = 4 * L * band * d + 2 * L * d * m + 4 * L * m * e
        backward_flops = 2 * forward
    elif implementation == "window-cache":
        forward = 4 * L * (C + window + sinks + DEFAULT_SPARSE_CACHE) * d
        backward_flops = 2 * forward
    elif implementation in ("sdpa", "eager"):
        forward, backward_flops = 4 * L * L * d, 10 * L * L * d
        if mode == "causal":
            forward, backward_flops = forward / 2, backward_flops / 2
    elif mode == "bidirectional":
        forward, backward_flops = 4 * L * m * d + 4 * L * m * e, 8 * L * m * d + 8 * L * m * e
    else:
        forward = 4 * L * m * d + 2 * L * C * (m + e) + 4 * L * m * e
        backward_flops = 12 * L * m * d + 6 * L * C * (m + e) + 10 * L * m * e
    return batch * heads * (forward + (backward_flops if backward else 0))


# ------------------------------------------------------------------------------------ one call


def kernel_record(device: torch.device, dtype: torch.dtype) -> dict:
    """Which path and linear backend the measured calls ran (:mod:`~hf_performer.linear_attention_parallel`,
    :mod:`~hf_performer.decayed_attention`)."""
    from ..decayed_attention import backend_for
    from ..linear_attention_parallel import attention_path, operand_dtype

    probe = torch.zeros(1, device=device, dtype=dtype)
    path = attention_path(probe)
    return {"attention_path": path,
            "linear_backend": backend_for(probe.to(operand_dtype(probe))) if path == "parallel" else "chunked loop"}


def _eager_attention(q, k, v, causal):
    """Materialised softmax, as transformers' eager attention: an [L, L] score matrix per head."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def make_attention_call(implementation: str, mode: str, head_dim: int, nb_features: int, chunk_size: int,
                        device: torch.device, clusters: int = DEFAULT_CLUSTERS, topk: int = DEFAULT_TOPK,
                        bucket_size: int = DEFAULT_BUCKET_SIZE, window: int = DEFAULT_WINDOW,
                        sinks: int = DEFAULT_SINKS, heads: int | None = None):
    """A function ``(q, k, v) -> out`` for one implementation and mode (``lsh`` ignores ``k``: shared QK;
    ``window`` needs ``heads``: its learned map and gamma are per head)."""
    causal = mode == "causal"
    if not runs_in_mode(implementation, mode):
        only = "bidirectional" if implementation in BIDIRECTIONAL_ONLY else "causal"
        raise ValueError(f"{implementation} attention is {only} only; got mode={mode!r}")
    if implementation == "clustered":
        return lambda q, k, v: clustered_attention(q, k, v, clusters=clusters)
    if implementation == "improved-clustered":
        return lambda q, k, v: improved_clustered_attention(q, k, v, clusters=clusters, topk=topk)
    if implementation == "lsh":
        return lambda q, k, v: lsh_attention(q, v, bucket_size=bucket_size)
    if implementation == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if implementation == "eager":
        return lambda q, k, v: _eager_attention(q, k, v, causal)
    if implementation == "favor":
        feature_map = make_feature_map("favor+", head_dim, nb_features=nb_features).to(device)
        return lambda q, k, v: linear_attention(q, k, v, feature_map, causal=causal, chunk_size=chunk_size)
    if implementation == "window":
        if heads is None:
            raise ValueError("the window implementation needs heads= (its tail map and gamma are per head)")
        feature_map = make_feature_map(WINDOW_FEATURE_MAP, head_dim, num_heads=heads).to(device)
        gamma = torch.full((heads,), WINDOW_GAMMA, device=device)
        return lambda q, k, v: window_linear_attention(q, k, v, feature_map, window=window, sinks=sinks,
                                                       causal=causal, softmax_weight=gamma, chunk_size=chunk_size)
    if implementation == "window-cache":
        return lambda q, k, v: window_linear_attention(q, k, v, None, window=window, sinks=sinks,
                                                       sparse_cache=DEFAULT_SPARSE_CACHE, chunk_size=chunk_size)
    raise ValueError(f"unknown implementation {implementation!r}; choose from {ATTENTION_IMPLEMENTATIONS}")


def time_attention_call(call, batch, heads, length, head_dim, device, dtype, backward=True, repeats=3) -> float:
    """Median seconds of ``repeats`` calls (forward, and backward if asked) after one warm-up."""
    return statistics.median(time_attention_calls(call, batch, heads, length, head_dim, device, dtype, backward,
                                                  repeats))


def time_attention_calls(call, batch, heads, length, head_dim, device, dtype, backward=True,
                         repeats=3) -> list[float]:
    """Seconds of each of ``repeats`` calls (forward, and backward if asked) after one warm-up."""
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))

    def one_call():
        out = call(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))
        return out

    def clear_gradients():
        q.grad = k.grad = v.grad = None

    return list(timed_calls(one_call, repeats, device, after=clear_gradients))


def peak_memory_bytes(implementation, mode, batch, heads, length, head_dim, nb_features, chunk_size, device,
                      dtype, backward=True, **options) -> int:
    """Extra peak memory of one call beyond its inputs.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU (which has no allocator statistics): a fresh
    process runs the call once and reports the growth of its peak resident set size.
    """
    if device.type == "cuda":
        shape = (batch, heads, length, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
        call = make_attention_call(implementation, mode, head_dim, nb_features, chunk_size, device, heads=heads,
                                   **options)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = call(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    request = dict(implementation=implementation, mode=mode, batch=batch, heads=heads, length=length,
                   head_dim=head_dim, nb_features=nb_features, chunk_size=chunk_size,
                   dtype=str(dtype).replace("torch.", ""), backward=backward, options=options)
    return int(run_in_fresh_process("hf_performer.bench.attention:_rss_child", request=request))


def _rss_child(request: dict) -> int:
    """Child process of :func:`peak_memory_bytes` on CPU: the growth of the peak resident set size during one call,
    in bytes."""
    dtype = getattr(torch, request["dtype"])
    device = torch.device("cpu")
    call = make_attention_call(request["implementation"], request["mode"], request["head_dim"],
                               request["nb_features"], request["chunk_size"], device, heads=request["heads"],
                               **request.get("options", {}))
    # Warm up on a tiny input so that library initialisation is not counted.
    tiny = [torch.randn(1, request["heads"], 64, request["head_dim"], dtype=dtype, requires_grad=True)
            for _ in range(3)]
    call(*tiny).sum().backward()
    shape = (request["batch"], request["heads"], request["length"], request["head_dim"])
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=request["backward"]) for _ in range(3))
    before = resident_bytes()
    reset_peak_resident()
    out = call(q, k, v)
    if request["backward"]:
        out.backward(torch.ones_like(out))
    return max(peak_resident_bytes() - before, 0)



# ------------------------------------------------------------------------------------ speed


def run_speed_benchmark(
    lengths=(512, 1024, 2048, 4096, 8192, 16384),
    batch: int = 1,
    heads: int = 12,
    head_dim: int = 64,
    nb_features: int = 256,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    modes=ATTENTION_MODES,
    implementations=DEFAULT_ATTENTION_IMPLEMENTATIONS,
    eager_max_length: int = 4096,
    clusters: int = DEFAULT_CLUSTERS,
    topk: int = DEFAULT_TOPK,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    window: int = DEFAULT_WINDOW,
    sinks: int = DEFAULT_SINKS,
    device: str = "cpu",
    dtype: str = "float32",
    repeats: int = 3,
    backward: bool = True,
    memory: bool = True,
    progress: bool = True,
) -> dict:
    """Time (and measure peak memory of) every implementation at every length, interleaved (the bidirectional-only
    implementations are skipped in causal mode)."""
    from tqdm.auto import tqdm

    device_ = torch.device(device)
    dtype_ = getattr(torch, dtype)
    records = []
    jobs = [(L, mode, impl) for L in lengths for mode in modes for impl in implementations
            if runs_in_mode(impl, mode) and not (impl == "eager" and L > eager_max_length)]
    options = dict(clusters=clusters, topk=topk, bucket_size=bucket_size, window=window, sinks=sinks)
    for length, mode, implementation in tqdm(jobs, desc="attention benchmark", disable=not progress):
        call = make_attention_call(implementation, mode, head_dim, nb_features, chunk_size, device_, heads=heads,
                                   **options)
        runs = time_attention_calls(call, batch, heads, length, head_dim, device_, dtype_, backward, repeats)
        seconds = statistics.median(runs)
        flops = attention_flops(implementation, mode, length, heads, head_dim, nb_features, batch, chunk_size, backward,
                                **options)
        record = dict(length=length, mode=mode, implementation=implementation, seconds=seconds,
                      gflops_per_s=flops / seconds / 1e9, flops=flops, runs=[round(t, 6) for t in runs])
        if memory:
            record["peak_memory_bytes"] = peak_memory_bytes(
                implementation, mode, batch, heads, length, head_dim, nb_features, chunk_size, device_, dtype_, backward,
                **options)
        records.append(record)
    result = {
        "benchmark": "attention_speed",
        "settings": dict(batch=batch, heads=heads, head_dim=head_dim, nb_features=nb_features, chunk_size=chunk_size,
                         dtype=dtype, backward=backward, repeats=repeats, lengths=list(lengths),
                         eager_max_length=eager_max_length, clusters=clusters, topk=topk, bucket_size=bucket_size,
                         hash_bits=DEFAULT_HASH_BITS, iterations=DEFAULT_ITERATIONS, window=window, sinks=sinks,
                         window_feature_map=WINDOW_FEATURE_MAP, window_nb_features=2 * head_dim,
                         sparse_cache=DEFAULT_SPARSE_CACHE),
        "machine": {**machine_info(device_), "load_average": load_average()},
        "matmul_gflops_per_s": matmul_gflops(device_, dtype_),
        "kernels": kernel_record(device_, dtype_),
        "records": records,
    }
    result["summary"] = summarize_speed(result)
    return result


def run_speed_benchmark_in_processes(processes: int, **arguments) -> dict:
    """:func:`run_speed_benchmark` in ``processes`` fresh processes (:func:`.machine.median_of_fresh_processes`):
    each point's ``seconds`` is the median of the processes' medians, ``process_seconds`` those medians (the spread
    between runs), ``runs`` every timed call."""
    merged = median_of_fresh_processes("hf_performer.bench.attention:run_speed_benchmark", processes,
                                       {"records": ("seconds",)}, ("length", "mode", "implementation"),
                                       pooled=("runs",), **arguments)
    for record in merged["records"]:
        record["gflops_per_s"] = record["flops"] / record["seconds"] / 1e9
    merged["summary"] = summarize_speed(merged)
    return merged


# ------------------------------------------------------------------------------------ memory


def run_memory_benchmark(
    lengths=(1024, 2048, 4096, 8192, 16384, 32768),
    batch: int = 1,
    heads: int = 12,
    head_dim: int = 64,
    nb_features: int = 256,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    modes=ATTENTION_MODES,
    implementations=("favor", "sdpa"),
    dtype: str = "float32",
    backward: bool = True,
    progress: bool = True,
    repeats: int = 1,
) -> dict:
    """Extra peak memory of one attention call (forward, and backward if asked), FAVOR+ against SDPA, length by
    length in the same run: each point runs in a fresh process (:func:`peak_memory_bytes`, CPU), which reports
    the growth of its peak resident set (``VmHWM`` after a reset, i.e. ``ru_maxrss`` for this call) beyond the
    inputs. The resident set counts every byte the call touched (torch's tensors and what the C allocator keeps),
    which is what decides an out-of-memory; a fresh process keeps earlier calls' caches out of it. With
    ``repeats`` > 1 each point is the median of that many processes (each one's figure kept in the record)."""
    from tqdm.auto import tqdm

    device_ = torch.device("cpu")
    dtype_ = getattr(torch, dtype)
    records = []
    jobs = [(L, mode, impl) for L in lengths for mode in modes for impl in implementations if runs_in_mode(impl, mode)]
    runs = {job: [] for job in jobs}
    # Whole rounds one after the other: a slow drift of the machine spreads over every point.
    for job in tqdm(jobs * repeats, desc="attention memory", disable=not progress):
        length, mode, implementation = job
        runs[job].append(peak_memory_bytes(implementation, mode, batch, heads, length, head_dim, nb_features,
                                           chunk_size, device_, dtype_, backward))
    for (length, mode, implementation), figures in runs.items():
        records.append(dict(length=length, mode=mode, implementation=implementation,
                            peak_memory_bytes=int(statistics.median(figures)),
                            **({"runs": figures} if repeats > 1 else {})))
    result = {
        "benchmark": "attention_memory",
        "settings": dict(batch=batch, heads=heads, head_dim=head_dim, nb_features=nb_features, chunk_size=chunk_size,
                         dtype=dtype, backward=backward, lengths=list(lengths), window=DEFAULT_WINDOW,
                         sinks=DEFAULT_SINKS, window_feature_map=WINDOW_FEATURE_MAP, window_nb_features=2 * head_dim,
                         sparse_cache=DEFAULT_SPARSE_CACHE, repeats=repeats,
                         measurement="growth of the peak resident set (VmHWM) of a fresh process during one call"),
        "machine": {**machine_info(device_), "load_average": load_average()},
        "kernels": kernel_record(device_, dtype_),
        "records": records,
    }
    result["summary"] = summarize_memory(result)
    return result


# ------------------------------------------------------------------------------------ approximation


def run_approximation_benchmark(
    head_dim: int = 100,
    nb_features=(10, 20, 50, 100, 150, 200, 300, 400),
    seeds: int = 25,
    length: int = 256,
    input_scale: float = 0.3,
    progress: bool = True,
) -> dict:
    """MSE of FAVOR+ (orthogonal and iid) against exact softmax attention, vs the number of features.

    Inputs: one head of ``length`` tokens with q, k, v ~ ``input_scale * N(0, I_d)`` (fixed), default
    temperature ``d ** -0.5``; each point averages ``seeds`` independent projections.
    """
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(0)
    q, k, v = (input_scale * torch.randn(1, 1, length, head_dim, generator=generator, dtype=torch.float64)
               for _ in range(3))
    exact = softmax_attention(q, k, v)
    records = []
    jobs = [(m, orthogonal) for m in nb_features for orthogonal in (True, False)]
    for m, orthogonal in tqdm(jobs, desc="approximation benchmark", disable=not progress):
        errors = []
        for seed in range(seeds):
            feature_map = make_feature_map("favor+", head_dim, nb_features=m, orthogonal=orthogonal, seed=seed).double()
            errors.append((linear_attention(q, k, v, feature_map) - exact).square().mean().item())
        records.append(dict(nb_features=m, projection="orthogonal" if orthogonal else "iid",
                            mse_mean=statistics.fmean(errors), mse_median=statistics.median(errors),
                            mse_std=statistics.pstdev(errors), mse_per_seed=errors))
    return {
        "benchmark": "favor_approximation",
        "settings": dict(head_dim=head_dim, nb_features=list(nb_features), seeds=seeds, length=length,
                         input_scale=input_scale, dtype="float64"),
        "machine": machine_info(torch.device("cpu")),
        "records": records,
    }


# ------------------------------------------------------------------------------------ whole-model forward speed


def time_model_forward(model, length: int, batch: int = 1, repeats: int = 3, seed: int = 0) -> float:
    """Median seconds of an inference forward on ``batch`` random sequences of ``length`` tokens (``input_ids``
    ``[batch, length]``), after one warm-up forward."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab, (batch, length), generator=generator)
    with torch.inference_mode():
        return statistics.median(timed_calls(lambda: model(input_ids=input_ids), repeats, model.device))


def forward_speed_comparison(source, performer, lengths, batch: int = 1, repeats: int = 3) -> list[dict]:
    """Forward time of the softmax source (SDPA) and the Performer model at each length, interleaved: one row
    ``{length, softmax_sdpa_s, favor_s, speedup}`` per length."""
    from tqdm.auto import tqdm

    rows = []
    for length in tqdm(lengths, desc="speed comparison"):
        softmax_s = time_model_forward(source, length, batch, repeats)
        favor_s = time_model_forward(performer, length, batch, repeats)
        rows.append(dict(length=length, softmax_sdpa_s=softmax_s, favor_s=favor_s, speedup=softmax_s / favor_s))
    return rows
