"""Decode attention peers in one run (issue 25, section 7): the machine's read roof and this
project's paged decode kernel (build/bench/paged_decode_bench, Google Benchmark), PyTorch 2.x
SDPA over a preallocated ("static") KV cache, the Hugging Face DynamicCache pattern (torch.cat
of the new token's K/V, then SDPA), and ONNX Runtime's com.microsoft GroupQueryAttention with
past KV, at a Llama-3-8B attention layer (32 query heads, 8 KV heads, head dim 128, one new
token per sequence). Run with the bench venv's Python (scripts/bench-deps: torch 2.x,
onnxruntime, onnx, numpy):

    build/bench-venv/bin/python bench/decode_peers.py [--bench build/bench/paged_decode_bench]
        [--rounds 3] [--min-seconds 0.4] [--json decode_peers.json] [--quick]

Every round measures every implementation at every shape, in an order that is reversed every
other time (A B C ... then ... C B A), so a drift in a shared host's speed favours none; each
ratio is taken within one round (the paged kernel against the read roof of the same
benchmark process; a peer against the paged kernel's run just before or after it) and the
median over rounds is shown. PyTorch and ONNX Runtime run in two long-lived worker processes
of this script (their thread pools never share a process), with their thread counts set to the
host's cores, as the paged kernel's pool is. Each worker checks its peer against a NumPy
reference before timing, so a wrong peer is never reported.

KV bytes read per step = B x L x 8 heads x (128 + 128) x element size; GB/s = 1e9 bytes/s.
"""
import argparse
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = [(4096, 1), (32768, 1), (4096, 8), (32768, 8)]  # (context L, batch B)
QUICK_SHAPES = [(4096, 1), (32768, 1)]
# Peer units: name -> (worker, element size in bytes, description).
PEERS = {
    "sdpa_f32": ("torch", 4, "PyTorch SDPA, static cache, enable_gqa"),
    "sdpa_bf16": ("torch", 2, "PyTorch SDPA, static cache, enable_gqa"),
    "sdpa_folded_f32": ("torch", 4, "PyTorch SDPA, static cache, 4 query heads folded as rows"),
    "sdpa_folded_bf16": ("torch", 2, "PyTorch SDPA, static cache, 4 query heads folded as rows"),
    "hf_dynamic_f32": ("torch", 4, "HF DynamicCache pattern: torch.cat + SDPA enable_gqa"),
    "ort_gqa_f32": ("ort", 4, "ORT GroupQueryAttention, past/present share buffer"),
    "ort_gqa_copy_f32": ("ort", 4, "ORT GroupQueryAttention, present = past + new (copy)"),
}


def kv_bytes(batch, context, element_bytes):
    return batch * context * KV_HEADS * 2 * HEAD_DIM * element_bytes


def cores():
    return len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------------------------
# Workers: one process per peer library, answering JSON requests on stdin with JSON lines.


def reference(q, k, v):
    """NumPy decode attention: q [B, 32, D], k/v [B, 8, L, D] (float64) -> [B, 32, D]."""
    import numpy as np
    batch = q.shape[0]
    grouped = q.reshape(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    scores = np.einsum("bgqd,bgld->bgql", grouped, k) / np.sqrt(HEAD_DIM)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    return np.einsum("bgql,bgld->bgqd", scores, v).reshape(batch, HEADS, HEAD_DIM)


def time_steps(step, min_seconds, min_steps):
    """Mean seconds per call of `step` over >= min_seconds and >= min_steps, after a warm-up
    call (which also faults in fresh pages)."""
    step()
    steps, start = 0, time.perf_counter()
    while steps < min_steps or time.perf_counter() - start < min_seconds:
        step()
        steps += 1
    return (time.perf_counter() - start) / steps, steps


class TorchWorker:
    def __init__(self, threads):
        import torch
        self.torch = torch
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.sdpa = torch.nn.functional.scaled_dot_product_attention

    def info(self):
        torch = self.torch
        return {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}

    def filled(self, shape, dtype):
        """A tensor of `shape` with small random values, filled at memory speed (a random tile
        repeated along the token axis; the kernels' speed does not depend on the values)."""
        torch = self.torch
        tokens = shape[2]
        tile = torch.randn(shape[0], shape[1], min(tokens, 256), shape[3]).to(dtype)
        out = torch.empty(shape, dtype=dtype)
        for start in range(0, tokens, tile.shape[2]):
            end = min(tokens, start + tile.shape[2])
            out[:, :, start:end].copy_(tile[:, :, :end - start])
        return out

    def make_step(self, peer, batch, context):
        torch, sdpa = self.torch, self.sdpa
        dtype = torch.bfloat16 if peer.endswith("bf16") else torch.float32
        q = torch.randn(batch, HEADS, 1, HEAD_DIM).to(dtype)
        k_new = torch.randn(batch, KV_HEADS, 1, HEAD_DIM).to(dtype)
        v_new = torch.randn(batch, KV_HEADS, 1, HEAD_DIM).to(dtype)
        if peer.startswith("sdpa_"):
            # Static cache: preallocated at L; the step writes the new token at L - 1 and
            # attends to all L tokens.
            k_cache = self.filled((batch, KV_HEADS, context, HEAD_DIM), dtype)
            v_cache = self.filled((batch, KV_HEADS, context, HEAD_DIM), dtype)
            folded = q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)

            def step():
                k_cache[:, :, context - 1:].copy_(k_new)
                v_cache[:, :, context - 1:].copy_(v_new)
                if "folded" in peer:
                    # The 4 query heads that share a KV head (consecutive heads, as repeat_kv
                    # pairs them) as 4 query rows of one head: SDPA reads each KV head once
                    # (enable_gqa's CPU flash kernel reads it once per query head).
                    return sdpa(folded, k_cache, v_cache).view(batch, HEADS, 1, HEAD_DIM)
                return sdpa(q, k_cache, v_cache, enable_gqa=True)
            return step, (q, k_cache, v_cache)
        if peer == "hf_dynamic_f32":
            # DynamicCache.update: torch.cat of the cache (L - 1 tokens) and the new token, then
            # transformers' sdpa_attention_forward, which passes enable_gqa=True when there is
            # no mask (transformers 5.x, use_gqa_in_sdpa). The cat's result would become the
            # next step's cache; it is dropped here so every step is at L.
            k_past = self.filled((batch, KV_HEADS, context - 1, HEAD_DIM), dtype)
            v_past = self.filled((batch, KV_HEADS, context - 1, HEAD_DIM), dtype)
            state = {}

            def step():
                k = torch.cat([k_past, k_new], dim=-2)
                v = torch.cat([v_past, v_new], dim=-2)
                state["kv"] = (k, v)
                return sdpa(q, k, v, enable_gqa=True)

            def operands():
                return q, *state["kv"]
            return step, operands
        raise ValueError(peer)

    def check(self):
        """Each torch peer against the NumPy reference at a small shape."""
        import numpy as np
        errors = {}
        for peer in [p for p in PEERS if PEERS[p][0] == "torch"]:
            step, operands = self.make_step(peer, 2, 96)
            with self.torch.inference_mode():
                out = step().float().numpy()[:, :, 0]
            q, k, v = operands() if callable(operands) else operands
            want = reference(q.double().numpy()[:, :, 0], k.double().numpy(),
                             v.double().numpy())
            errors[peer] = float(np.abs(out - want).max())
            limit = 3e-2 if peer.endswith("bf16") else 1e-4
            if errors[peer] > limit:
                raise RuntimeError(f"{peer} differs from the reference by {errors[peer]}")
        return errors

    def measure(self, peer, batch, context, min_seconds, min_steps):
        step, _ = self.make_step(peer, batch, context)
        with self.torch.inference_mode():
            return time_steps(step, min_seconds, min_steps)


class OrtWorker:
    def __init__(self, threads):
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
        self.np, self.ort = np, ort
        self.threads = threads
        node = helper.make_node(
            "GroupQueryAttention",
            ["query", "key", "value", "past_key", "past_value", "seqlens_k",
             "total_sequence_length"],
            ["output", "present_key", "present_value"], domain="com.microsoft",
            num_heads=HEADS, kv_num_heads=KV_HEADS)
        value = helper.make_tensor_value_info
        floats = TensorProto.FLOAT
        graph = helper.make_graph(
            [node], "decode_gqa",
            [value("query", floats, ["B", 1, HEADS * HEAD_DIM]),
             value("key", floats, ["B", 1, KV_HEADS * HEAD_DIM]),
             value("value", floats, ["B", 1, KV_HEADS * HEAD_DIM]),
             value("past_key", floats, ["B", KV_HEADS, "P", HEAD_DIM]),
             value("past_value", floats, ["B", KV_HEADS, "P", HEAD_DIM]),
             value("seqlens_k", TensorProto.INT32, ["B"]),
             value("total_sequence_length", TensorProto.INT32, [])],
            [value("output", floats, ["B", 1, HEADS * HEAD_DIM]),
             value("present_key", floats, ["B", KV_HEADS, "T", HEAD_DIM]),
             value("present_value", floats, ["B", KV_HEADS, "T", HEAD_DIM])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])

    def info(self):
        return {"onnxruntime": self.ort.__version__, "ort_intra_op_threads": self.threads}

    def filled(self, shape):
        np = self.np
        tokens = shape[2]
        tile = np.random.default_rng(1).standard_normal(
            (shape[0], shape[1], min(tokens, 256), shape[3]), dtype=np.float32)
        out = np.empty(shape, dtype=np.float32)
        for start in range(0, tokens, tile.shape[2]):
            end = min(tokens, start + tile.shape[2])
            out[:, :, start:end] = tile[:, :, :end - start]
        return out

    def make_step(self, peer, batch, context):
        np, ort = self.np, self.ort
        rng = np.random.default_rng(2)
        q = rng.standard_normal((batch, 1, HEADS * HEAD_DIM), dtype=np.float32)
        k = rng.standard_normal((batch, 1, KV_HEADS * HEAD_DIM), dtype=np.float32)
        v = rng.standard_normal((batch, 1, KV_HEADS * HEAD_DIM), dtype=np.float32)
        seqlens = np.full((batch,), context - 1, np.int32)  # index of the last token
        total = np.array(context, np.int32)
        binding = self.session.io_binding()
        binding.bind_cpu_input("query", q)
        binding.bind_cpu_input("key", k)
        binding.bind_cpu_input("value", v)
        binding.bind_cpu_input("seqlens_k", seqlens)
        binding.bind_cpu_input("total_sequence_length", total)
        binding.bind_output("output", "cpu")
        if peer == "ort_gqa_f32":
            # The KV-cache mode of onnxruntime-genai: past and present are one buffer of the
            # cache's full length (L); the op writes the new token at seqlens_k and attends to
            # the first total_sequence_length tokens.
            past_k = self.filled((batch, KV_HEADS, context, HEAD_DIM))
            past_v = self.filled((batch, KV_HEADS, context, HEAD_DIM))
            k_value = ort.OrtValue.ortvalue_from_numpy(past_k)
            v_value = ort.OrtValue.ortvalue_from_numpy(past_v)
            binding.bind_ortvalue_input("past_key", k_value)
            binding.bind_ortvalue_input("past_value", v_value)
            binding.bind_ortvalue_output("present_key", k_value)
            binding.bind_ortvalue_output("present_value", v_value)
        elif peer == "ort_gqa_copy_f32":
            # Past of L - 1 tokens in, present of L tokens out (a fresh buffer each step): the
            # op copies the past into the present, as an exported model without buffer sharing
            # runs it.
            past_k = self.filled((batch, KV_HEADS, context - 1, HEAD_DIM))
            past_v = self.filled((batch, KV_HEADS, context - 1, HEAD_DIM))
            binding.bind_cpu_input("past_key", past_k)
            binding.bind_cpu_input("past_value", past_v)
            binding.bind_output("present_key", "cpu")
            binding.bind_output("present_value", "cpu")
        else:
            raise ValueError(peer)
        run_options = ort.RunOptions()

        def step():
            self.session.run_with_iobinding(binding, run_options)

        def check():
            keys = np.concatenate([past_k[:, :, :context - 1],
                                   k.reshape(batch, KV_HEADS, 1, HEAD_DIM)], axis=2)
            values = np.concatenate([past_v[:, :, :context - 1],
                                     v.reshape(batch, KV_HEADS, 1, HEAD_DIM)], axis=2)
            want = reference(q.reshape(batch, HEADS, HEAD_DIM).astype(np.float64),
                             keys.astype(np.float64), values.astype(np.float64))
            got = binding.copy_outputs_to_cpu()[0].reshape(batch, HEADS, HEAD_DIM)
            return float(np.abs(got - want).max())
        return step, check

    def check(self):
        errors = {}
        for peer in ("ort_gqa_f32", "ort_gqa_copy_f32"):
            step, check = self.make_step(peer, 2, 96)
            step()
            errors[peer] = check()
            if errors[peer] > 1e-4:
                raise RuntimeError(f"{peer} differs from the reference by {errors[peer]}")
        return errors

    def measure(self, peer, batch, context, min_seconds, min_steps):
        step, _ = self.make_step(peer, batch, context)
        return time_steps(step, min_seconds, min_steps)


def worker_main(kind, threads):
    """Serves requests {"peer", "B", "L", "min_seconds", "min_steps"} on stdin, one JSON line
    each, answering one JSON line on stdout; the first answer is the worker's info and its
    check against the reference (or its error)."""
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    try:
        worker = TorchWorker(threads) if kind == "torch" else OrtWorker(threads)
        hello = {"info": worker.info(), "check_max_abs_error": worker.check()}
    except Exception as error:  # reported, not raised: the run goes on without this peer
        hello = {"error": f"{type(error).__name__}: {error}"}
        worker = None
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            seconds, steps = worker.measure(request["peer"], request["B"], request["L"],
                                            request["min_seconds"], request["min_steps"])
            answer = {"seconds_per_step": seconds, "steps": steps}
        except Exception as error:
            answer = {"error": f"{type(error).__name__}: {error}"}
        gc.collect()  # free the unit's buffers before the next one runs
        out.write(json.dumps(answer) + "\n")
        out.flush()


class Worker:
    def __init__(self, python, kind, threads):
        self.kind = kind
        self.process = subprocess.Popen(
            [python, os.path.abspath(__file__), "--worker", kind, "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        self.hello = json.loads(line) if line else {"error": "worker exited"}

    @property
    def ok(self):
        return "error" not in self.hello

    def measure(self, peer, batch, context, min_seconds, min_steps):
        self.process.stdin.write(json.dumps({"peer": peer, "B": batch, "L": context,
                                             "min_seconds": min_seconds,
                                             "min_steps": min_steps}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        return json.loads(line) if line else {"error": "worker exited"}

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)


# ---------------------------------------------------------------------------------------------
# The paged kernel and the read roof: one paged_decode_bench process per shape and round.


def run_ours(bench, batch, context, min_seconds):
    pattern = f"^BM_ReadBandwidth/|^BM_PagedDecode/context:{context}/B:{batch}/"
    output = subprocess.run(
        [bench, f"--benchmark_filter={pattern}", "--benchmark_format=json",
         f"--benchmark_min_time={min_seconds}"],
        check=True, capture_output=True, text=True).stdout
    result = {}
    for entry in json.loads(output)["benchmarks"]:
        if entry.get("error_occurred"):
            raise RuntimeError(f"{entry['name']}: {entry.get('error_message')}")
        if entry["name"].startswith("BM_ReadBandwidth"):
            result["roof"] = {"bytes_per_s": entry["read_bytes/s"],
                              "threads": int(entry["threads"]), "simd": entry.get("label")}
        else:
            dtype = "bf16" if "/bf16:1/" in entry["name"] else "f32"
            seconds = entry["real_time"] * {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}[
                entry["time_unit"]]
            result["ours_" + dtype] = {"bytes_per_s": entry["KV_bytes/s"],
                                       "seconds_per_step": seconds,
                                       "iterations": entry["iterations"]}
    return result


def registered_dtypes(bench):
    names = subprocess.run([bench, "--benchmark_list_tests"], check=True, capture_output=True,
                           text=True).stdout.split()
    return {"f32": any("/bf16:0/" in n for n in names), "bf16": any("/bf16:1/" in n for n in names)}


# ---------------------------------------------------------------------------------------------
# The host.


def host_info():
    model = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        match = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
        model = match.group(1).strip() if match else ""
    except OSError:
        pass
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    thp = ""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    return {"cpu_model": model, "cores": cores(),
            "cpu_flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")},
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
            "transparent_hugepage": thp, "load_average_start": list(os.getloadavg()),
            "python": sys.version.split()[0],
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}


# ---------------------------------------------------------------------------------------------


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, pattern):
    return "—" if value is None else format(value, pattern)


def print_goals(rows):
    """Issue 25's goals for the CPU paged decode kernel, float32 KV."""
    def value(unit, context, batch, key):
        for row in rows:
            if (row["unit"], row["L"], row["B"]) == (unit, context, batch):
                return row[key]
        return None
    goals = [("ours of the read roof, 32k, B = 1",
              value("ours_f32", 32768, 1, "of_read_roof"), 0.70),
             ("ours of the read roof, 4k, B = 1",
              value("ours_f32", 4096, 1, "of_read_roof"), 0.50)]
    for batch in (1, 8):
        for unit, label, target in (("sdpa_f32", "PyTorch SDPA enable_gqa", 5.0),
                                    ("sdpa_folded_f32", "PyTorch SDPA folded", 5.0),
                                    ("ort_gqa_f32", "ORT GQA (share buffer)", 4.0),
                                    ("ort_gqa_copy_f32", "ORT GQA (copy)", 4.0)):
            goals.append((f"ours / {label}, 32k, B = {batch}",
                          value(unit, 32768, batch, "ours_over_this"), target))
    print("\nGoals (float32 KV):")
    for label, got, target in goals:
        if got is None:
            continue
        print(f"- {label}: {got:.2f} (goal >= {target:g}: "
              f"{'met' if got >= target else 'missed'})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default="build/bench/paged_decode_bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.4,
                        help="timed seconds per implementation, shape and round")
    parser.add_argument("--min-steps", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="a short test run: B = 1 only, one round, 0.1 s each")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", choices=["torch", "ort"], help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=cores(), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.threads)
        return
    if args.quick:
        args.rounds, args.min_seconds, args.min_steps = 1, 0.1, 2
    shapes = QUICK_SHAPES if args.quick else SHAPES
    started = time.time()
    host = host_info()
    threads = cores()
    dtypes = registered_dtypes(args.bench)
    workers = {kind: Worker(sys.executable, kind, threads) for kind in ("torch", "ort")}
    for worker in workers.values():
        if not worker.ok:
            print(f"decode_peers: the {worker.kind} worker failed: {worker.hello['error']}",
                  file=sys.stderr)
    peers = [p for p in PEERS if workers[PEERS[p][0]].ok]
    units = ["ours"] + peers
    # samples[(context, batch)][unit name] = one dict per round
    samples = {shape: {} for shape in shapes}
    errors = {}
    for round_index in range(args.rounds):
        for shape_index, (context, batch) in enumerate(shapes):
            order = units if (round_index + shape_index) % 2 == 0 else units[::-1]
            for unit in order:
                if unit == "ours":
                    try:
                        for name, value in run_ours(args.bench, batch, context,
                                                    args.min_seconds).items():
                            samples[(context, batch)].setdefault(name, []).append(value)
                    except (subprocess.CalledProcessError, RuntimeError) as error:
                        errors[f"ours L={context} B={batch}"] = str(error)
                    continue
                answer = workers[PEERS[unit][0]].measure(unit, batch, context,
                                                         args.min_seconds, args.min_steps)
                if "error" in answer:
                    errors[f"{unit} L={context} B={batch}"] = answer["error"]
                    samples[(context, batch)].setdefault(unit, []).append(None)
                    continue
                answer["bytes_per_s"] = (kv_bytes(batch, context, PEERS[unit][1])
                                         / answer["seconds_per_step"])
                samples[(context, batch)].setdefault(unit, []).append(answer)
            print(f"decode_peers: round {round_index + 1}/{args.rounds} L={context} B={batch} "
                  f"done at {time.time() - started:.0f} s", file=sys.stderr)
    for worker in workers.values():
        worker.close()
    host["load_average_end"] = list(os.getloadavg())
    host["threads"] = threads
    for worker in workers.values():
        host.update(worker.hello.get("info", {}))
    roof_info = next((s["roof"][0] for s in samples.values() if s.get("roof")), {})
    host["read_roof_threads"] = roof_info.get("threads")
    host["our_simd_level"] = roof_info.get("simd")

    def per_round(shape, unit, over=None, ratio_of=None):
        """Median over rounds of unit's bytes/s (or of its ratio to `over`'s bytes/s, or of
        `ratio_of`'s step rate over unit's) within the same round."""
        rounds = samples[shape]
        mine = rounds.get(unit, [])
        if over is None and ratio_of is None:
            return median([m["bytes_per_s"] if m else None for m in mine])
        values = []
        for index, m in enumerate(mine):
            other = rounds.get(over or ratio_of, [])
            o = other[index] if index < len(other) else None
            if not m or not o:
                continue
            if over:
                values.append(m["bytes_per_s"] / o["bytes_per_s"])
            else:  # steps per second of ratio_of over unit's
                values.append(m["seconds_per_step"] / o["seconds_per_step"])
        return median(values)

    rows = []
    names = {"ours_f32": ("ours: paged decode kernel", "float32", 4),
             "ours_bf16": ("ours: paged decode kernel", "bfloat16", 2)}
    for peer, (_, size, description) in PEERS.items():
        names[peer] = (description, "bfloat16" if size == 2 else "float32", size)
    print(f"\nHost: {host['cpu_model']}, {host['cores']} cores; our SIMD level "
          f"{host['our_simd_level']}; avx512f {host['cpu_flags']['avx512f']}, avx512_bf16 "
          f"{host['cpu_flags']['avx512_bf16']}, avx2 {host['cpu_flags']['avx2']}; "
          f"OPENBLAS_CORETYPE={host['OPENBLAS_CORETYPE']}; threads: ours {threads}, torch "
          f"{host.get('torch_threads')}, ORT {host.get('ort_intra_op_threads')}; torch "
          f"{host.get('torch')} ({host.get('torch_cpu_capability')}), onnxruntime "
          f"{host.get('onnxruntime')}; load average {host['load_average_start'][0]:.1f} -> "
          f"{host['load_average_end'][0]:.1f}; {args.rounds} rounds, "
          f"{time.time() - started:.0f} s\n")
    print("| L | B | implementation | KV dtype | ms/step | KV GB/s | of read roof "
          "| ours ÷ this (same dtype) |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        context, batch = shape
        roof = median([r["bytes_per_s"] for r in samples[shape].get("roof", [])])
        print(f"| {context // 1024}k | {batch} | read roof (BM_ReadBandwidth) | — | — | "
              f"{fmt(roof and roof / 1e9, '.1f')} | 1 | — |")
        for unit in ["ours_f32", "ours_bf16"] + peers:
            if unit not in samples[shape]:
                continue
            description, dtype, _ = names[unit]
            ours = "ours_bf16" if dtype == "bfloat16" else "ours_f32"
            rate = per_round(shape, unit)
            seconds = median([m["seconds_per_step"] if m else None
                              for m in samples[shape][unit]])
            of_roof = per_round(shape, unit, over="roof")
            speedup = None if unit.startswith("ours") else per_round(shape, unit, ratio_of=ours)
            rows.append({"L": context, "B": batch, "unit": unit, "implementation": description,
                         "kv_dtype": dtype, "ms_per_step": seconds and seconds * 1e3,
                         "kv_gb_per_s": rate and rate / 1e9, "of_read_roof": of_roof,
                         "ours_over_this": speedup, "read_roof_gb_per_s": roof and roof / 1e9,
                         "rounds": samples[shape][unit]})
            print(f"| {context // 1024}k | {batch} | {description} | {dtype} | "
                  f"{fmt(seconds and seconds * 1e3, '.2f')} | {fmt(rate and rate / 1e9, '.1f')} | "
                  f"{fmt(of_roof, '.2f')} | {fmt(speedup, '.2f')} |")
    print_goals(rows)
    if errors:
        print("\nErrors:")
        for where, error in errors.items():
            print(f"- {where}: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host, "command": sys.argv, "rounds": args.rounds,
                       "min_seconds": args.min_seconds,
                       "check_max_abs_error": {w.kind: w.hello.get("check_max_abs_error")
                                               for w in workers.values()},
                       "rows": rows, "roof_rounds": {f"{c}x{b}": samples[(c, b)].get("roof")
                                                     for c, b in shapes},
                       "errors": errors, "registered_dtypes": dtypes}, f, indent=1)


if __name__ == "__main__":
    main()
