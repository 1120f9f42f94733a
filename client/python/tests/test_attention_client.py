"""The attention_client package against a real attention-server on a free port.

    ATTENTION_SERVER=build/server/attention-server \
        python -m unittest discover -s client/python/tests

Runs wherever the package imports: in a fresh venv with PyPI's grpcio / protobuf / numpy
(ctest python_client_venv) and under Debian's python3 (python_client_package_debian), which
also has torch. Without ATTENTION_SERVER every test is skipped. ATTENTION_CLIENT_INSTALLED=1
asserts that the package under test is an installed copy, not the checkout's.
"""

import asyncio
import json
import os
import struct
import tempfile
import unittest

import grpc
import numpy as np

import attention_client as ac
from attention_client import AsyncAttentionClient, AttentionClient, sources, tensors
from attention_client.server_process import ServerProcess, make_test_certificates

try:
    import torch
except ImportError:
    torch = None

SERVER = os.environ.get("ATTENTION_SERVER")
SEED = int(os.environ.get("ATTENTION_TEST_SEED", "20261123"))
E, HEADS = 16, 4
CONFIG = {"embed_dim": E, "num_heads": HEADS}
_server = None
_repository = None


def setUpModule():
    global _server, _repository
    if not SERVER:
        raise unittest.SkipTest("set ATTENTION_SERVER to an attention-server binary")
    if not os.path.isfile(SERVER):
        raise FileNotFoundError("ATTENTION_SERVER=%s is not a file" % SERVER)
    print("seed %d (ATTENTION_TEST_SEED)" % SEED)
    _repository = tempfile.TemporaryDirectory()
    _server = ServerProcess(SERVER, "--compute_threads=1",
                            "--model_repository=" + _repository.name).start()


def tearDownModule():
    if _server is not None:
        code = _server.stop()
        _repository.cleanup()
        if code != 0:
            raise AssertionError("server exit code %s after SIGTERM; stderr:\n%s"
                                 % (code, _server.stderr_text()[-4000:]))


def native_weights(rng):
    """Random native-named weights of a CONFIG layer."""
    weights = {}
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        weights[name + ".weight"] = rng.uniform(-0.3, 0.3, size=(E, E)).astype(np.float32)
        weights[name + ".bias"] = rng.uniform(-0.3, 0.3, size=(E,)).astype(np.float32)
    return weights


def hf_bert_names(weights, prefix=""):
    """Native names -> Hugging Face BERT self-attention names."""
    names = {"q_proj": "attention.self.query", "k_proj": "attention.self.key",
             "v_proj": "attention.self.value", "out_proj": "attention.output.dense"}
    return {prefix + names[k.split(".")[0]] + "." + k.split(".")[1]: v
            for k, v in weights.items()}


def torch_mha_names(weights):
    """Native names -> nn.MultiheadAttention state_dict names."""
    qkv = ("q_proj", "k_proj", "v_proj")
    return {"in_proj_weight": np.concatenate([weights[p + ".weight"] for p in qkv]),
            "in_proj_bias": np.concatenate([weights[p + ".bias"] for p in qkv]),
            "out_proj.weight": weights["out_proj.weight"],
            "out_proj.bias": weights["out_proj.bias"]}


def save_safetensors(path, arrays):
    """float32 arrays -> a safetensors file (u64 LE header size, JSON header, data)."""
    header, chunks, offset = {}, [], 0
    for name, array in arrays.items():
        raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header).encode()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def mha_reference(x, w):
    """float64 numpy self-attention with native weights, no masks."""
    x = x.astype(np.float64)
    b, n, _ = x.shape
    d = E // HEADS

    def heads(name):
        y = x @ w[name + ".weight"].T.astype(np.float64) + w[name + ".bias"]
        return y.reshape(b, n, HEADS, d).transpose(0, 2, 1, 3)
    s = heads("q_proj") @ heads("k_proj").transpose(0, 1, 3, 2) / np.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = (p @ heads("v_proj")).transpose(0, 2, 1, 3).reshape(b, n, E)
    return ctx @ w["out_proj.weight"].T + w["out_proj.bias"]


class InstalledPackage(unittest.TestCase):
    def test_package_location(self):
        if os.environ.get("ATTENTION_CLIENT_INSTALLED") != "1":
            self.skipTest("ATTENTION_CLIENT_INSTALLED is not 1")
        self.assertIn("site-packages", ac.__file__)
        from attention_client import stubs
        self.assertIn("site-packages", stubs.load()[0].__file__)


class ArgumentChecks(unittest.TestCase):
    """Rejections the client makes before any call."""

    def test_exactly_one_weight_source(self):
        with self.assertRaisesRegex(ValueError, "exactly one of weights, random_seed or source"):
            ac.make_layer_spec(CONFIG, native_weights(np.random.default_rng(SEED)),
                               random_seed=1)
        with self.assertRaisesRegex(ValueError, "exactly one"):
            ac.make_layer_spec(CONFIG)

    def test_unknown_naming(self):
        with self.assertRaisesRegex(ValueError, "unknown weight naming 'keras'.*hf_bert"):
            sources.safetensors("x.safetensors", naming="keras")

    def test_naming_spellings(self):
        pb2 = ac.client.stubs.load()[0]
        for spelling in ("hf_llama", "HF_LLAMA", "WEIGHT_NAMING_HF_LLAMA",
                         pb2.WEIGHT_NAMING_HF_LLAMA):
            self.assertEqual(sources.naming_enum(spelling), pb2.WEIGHT_NAMING_HF_LLAMA)

    def test_tls_options(self):
        with self.assertRaisesRegex(ValueError, "need tls_ca_file"):
            AttentionClient("127.0.0.1:1", tls_cert_file="c.pem", tls_key_file="c.key")
        with tempfile.NamedTemporaryFile() as ca:
            with self.assertRaisesRegex(ValueError, "both tls_cert_file and tls_key_file"):
                AttentionClient("127.0.0.1:1", tls_ca_file=ca.name, tls_cert_file=ca.name)

    def test_unknown_dtype_and_need_weights(self):
        x = np.zeros((1, 2, E), np.float32)
        with self.assertRaisesRegex(ValueError, "unknown dtype 'float8'"):
            ac.messages.mha_request(x, layer="l", dtype="float8")
        with self.assertRaisesRegex(ValueError, "unknown need_weights 'all'"):
            ac.messages.mha_request(x, layer="l", need_weights="all")


class Blocking(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = AttentionClient(_server.target)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def test_every_weight_source_gives_the_same_layer(self):
        rng = np.random.default_rng(SEED)
        weights, other = native_weights(rng), native_weights(rng)
        x = rng.normal(size=(2, 5, E)).astype(np.float32)
        # A two-layer checkpoint with the rest of a model beside it: the prefix picks one.
        save_safetensors(os.path.join(_repository.name, "bert", "model.safetensors"), {
            **hf_bert_names(other, "encoder.layer.0."),
            **hf_bert_names(weights, "encoder.layer.1."),
            "embeddings.word_embeddings.weight": rng.normal(size=(30, E))})
        loads = {
            "weights": dict(weights=weights),
            "inline-torch-mha": dict(source=sources.inline(torch_mha_names(weights),
                                                           naming="torch_mha")),
            "inline-hf-bert-prefix": dict(source=sources.inline(
                hf_bert_names(weights, "layer.7."), naming="hf_bert", prefix="layer.7.")),
            "safetensors": dict(source=sources.safetensors(
                "bert/model.safetensors", naming="hf_bert", prefix="encoder.layer.1.")),
        }
        outputs = {}
        for name, load in loads.items():
            info = self.client.load_layer("src-" + name, CONFIG, **load)
            self.assertEqual(info.parameter_count, 4 * (E * E + E), name)
            outputs[name] = self.client.multi_head_attention(x, layer="src-" + name).output
        np.testing.assert_allclose(outputs["weights"], mha_reference(x, weights), atol=1e-5)
        for name, output in outputs.items():
            np.testing.assert_array_equal(output, outputs["weights"], err_msg=name)
        layer0 = self.client.load_layer("src-layer0", CONFIG, source=sources.safetensors(
            "bert/model.safetensors", naming="hf_bert", prefix="encoder.layer.0."))
        self.assertGreater(layer0.version, 0)
        np.testing.assert_allclose(self.client.multi_head_attention(x, layer="src-layer0").output,
                                   mha_reference(x, other), atol=1e-5)
        for name in list(loads) + ["layer0"]:
            self.client.unload_layer("src-" + name)

    def test_hf_checkpoint_directory_by_layer_index(self):
        rng = np.random.default_rng(SEED + 1)
        layers = [native_weights(rng), native_weights(rng)]
        directory = os.path.join(_repository.name, "tiny-bert")
        save_safetensors(os.path.join(directory, "model.safetensors"), {
            **hf_bert_names(layers[0], "encoder.layer.0."),
            **hf_bert_names(layers[1], "encoder.layer.1.")})
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({"model_type": "bert", "hidden_size": E,
                       "num_attention_heads": CONFIG["num_heads"], "num_hidden_layers": 2}, f)
        listing = self.client.inspect_checkpoint("tiny-bert")
        self.assertEqual(listing.total_tensors, 16)
        self.assertEqual(listing.model_type, "bert")
        bert = [entry for entry in listing.layers
                if entry.naming == self.client.pb2.WEIGHT_NAMING_HF_BERT]
        self.assertEqual(list(bert[0].prefixes), ["encoder.layer.0.", "encoder.layer.1."])
        x = rng.normal(size=(1, 4, E)).astype(np.float32)
        info = self.client.load_layer("hf-dir-1", source=sources.hf_checkpoint("tiny-bert", 1))
        self.assertEqual(info.config.num_heads, CONFIG["num_heads"])
        np.testing.assert_allclose(self.client.multi_head_attention(x, layer="hf-dir-1").output,
                                   mha_reference(x, layers[1]), atol=1e-5)
        with self.assertRaises(grpc.RpcError) as caught:
            self.client.load_layer("hf-dir-bad", {"embed_dim": E, "num_heads": 1},
                                   source=sources.hf_checkpoint("tiny-bert", 0))
        self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("num_heads", caught.exception.details())
        self.client.unload_layer("hf-dir-1")

    def test_wrong_prefix_is_invalid_argument(self):
        save_safetensors(os.path.join(_repository.name, "one.safetensors"),
                         hf_bert_names(native_weights(np.random.default_rng(SEED))))
        with self.assertRaises(grpc.RpcError) as caught:
            self.client.load_layer("bad-prefix", CONFIG, source=sources.safetensors(
                "one.safetensors", naming="hf_bert", prefix="encoder.layer.9."))
        self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("encoder.layer.9.attention.self.query", caught.exception.details())

    def test_random_init_is_seeded(self):
        x = np.random.default_rng(SEED).normal(size=(1, 4, E)).astype(np.float32)
        out = {}
        for name, seed in (("a", 5), ("b", 5), ("c", 6)):
            self.client.load_layer("rand-" + name, CONFIG, source=sources.random_init(seed))
            out[name] = self.client.multi_head_attention(x, layer="rand-" + name).output
            self.client.unload_layer("rand-" + name)
        np.testing.assert_array_equal(out["a"], out["b"])
        self.assertFalse(np.array_equal(out["a"], out["c"]))

    def test_half_inputs_travel_as_such(self):
        self.client.load_layer("half", CONFIG, random_seed=3)
        x = np.random.default_rng(SEED).normal(size=(1, 3, E)).astype(np.float16)
        r = self.client.multi_head_attention(x, layer="half", need_weights="per_head")
        self.assertEqual(r.output_dtype, tensors.FLOAT16)
        self.assertEqual((r.output.dtype, r.output.shape), (np.float32, (1, 3, E)))
        self.assertEqual(r.weights.shape, (1, HEADS, 3, 3))
        as_float32 = self.client.multi_head_attention(x.astype(np.float32), layer="half")
        self.assertEqual(as_float32.output_dtype, tensors.FLOAT32)
        np.testing.assert_array_equal(r.output, ac.round_to_dtype(as_float32.output, "float16"))
        self.client.unload_layer("half")

    def test_errors_carry_codes(self):
        with self.assertRaises(grpc.RpcError) as caught:
            self.client.multi_head_attention(np.zeros((1, 2, E), np.float32), layer="missing")
        self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as caught:
            self.client.scaled_dot_product_attention(np.zeros((1, 3, 2, 4), np.float32),
                                                     np.zeros((1, 2, 2, 4), np.float32),
                                                     np.zeros((1, 2, 2, 4), np.float32))
        self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)


@unittest.skipIf(torch is None, "torch is not installed")
class Torch(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = AttentionClient(_server.target)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def test_torch_mha_state_dict_in_and_out(self):
        torch.manual_seed(SEED)
        mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True).eval()
        self.client.load_layer("torch-mha", CONFIG, source=sources.inline(
            mha.state_dict(), naming="torch_mha"))
        x = torch.randn(2, 5, E)
        mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])  # tokenizer polarity, int
        with torch.no_grad():
            want, want_w = mha(x, x, x, key_padding_mask=mask == 0)
        r = self.client.multi_head_attention(x, layer="torch-mha", key_padding_mask=mask,
                                             key_padding_polarity="true_attends",
                                             need_weights="averaged")
        self.assertIsInstance(r.output, torch.Tensor)
        self.assertEqual(r.output.dtype, torch.float32)
        torch.testing.assert_close(r.output, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.weights, want_w, atol=1e-6, rtol=1e-5)
        self.client.unload_layer("torch-mha")

    def test_bfloat16_tensor_round_trip(self):
        q = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(SEED))
        r16 = self.client.scaled_dot_product_attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
        self.assertEqual((r16.output.dtype, r16.output_dtype), (torch.bfloat16, tensors.BFLOAT16))
        numpy_path = self.client.scaled_dot_product_attention(
            q.numpy(), q.numpy(), q.numpy(), dtype="bfloat16")
        np.testing.assert_array_equal(r16.output.float().numpy(), numpy_path.output)


class Async(unittest.IsolatedAsyncioTestCase):
    async def test_concurrent_calls_equal_blocking_ones(self):
        rng = np.random.default_rng(SEED)
        weights = native_weights(rng)
        xs = [rng.normal(size=(1, n, E)).astype(np.float32) for n in (1, 2, 3, 5, 7, 11)]
        async with AsyncAttentionClient(_server.target) as client:
            await client.wait_ready()
            self.assertEqual(await client.health(), "SERVING")
            info = await client.load_layer("async", CONFIG, weights=weights)
            self.assertEqual((await client.get_layer("async")).version, info.version)
            self.assertIn("async", [layer.name for layer in await client.list_layers()])
            results = await asyncio.gather(*(client.multi_head_attention(
                x, layer="async", need_weights="averaged", request_id=str(i))
                for i, x in enumerate(xs)))
            with AttentionClient(_server.target) as blocking:
                for i, (x, r) in enumerate(zip(xs, results)):
                    want = blocking.multi_head_attention(x, layer="async",
                                                         need_weights="averaged")
                    self.assertEqual(r.request_id, str(i))
                    # Concurrent calls share batches, whose GEMM blocking may differ.
                    np.testing.assert_allclose(r.output, want.output, atol=1e-6, rtol=1e-5)
                    np.testing.assert_allclose(r.weights, want.weights, atol=1e-6, rtol=1e-5)
            await client.unload_layer("async")
            with self.assertRaises(grpc.RpcError) as caught:
                await client.get_layer("async")
            self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)

    async def test_async_sdpa(self):
        q = np.random.default_rng(SEED).normal(size=(2, 2, 4, 8)).astype(np.float32)
        async with AsyncAttentionClient(_server.target) as client:
            r = await client.scaled_dot_product_attention(q, q, q, causal=True)
        with AttentionClient(_server.target) as blocking:
            want = blocking.scaled_dot_product_attention(q, q, q, causal=True)
        np.testing.assert_array_equal(r.output, want.output)


class TlsAndAdminToken(unittest.IsolatedAsyncioTestCase):
    """Mutual TLS and the admin token, through both clients."""

    @classmethod
    def setUpClass(cls):
        cls.directory = tempfile.TemporaryDirectory()
        try:
            path = make_test_certificates(cls.directory.name)
        except OSError as err:  # no openssl command
            raise unittest.SkipTest("openssl: %s" % err)
        cls.token = "package-test-admin-token-42"
        with open(path("token"), "w") as f:
            f.write(cls.token + "\n")
        cls.tls = dict(tls_ca_file=path("ca.pem"), tls_cert_file=path("client.pem"),
                       tls_key_file=path("client.key"))
        cls.server = ServerProcess(
            SERVER, "--compute_threads=1", "--tls_cert_file=" + path("server.pem"),
            "--tls_key_file=" + path("server.key"), "--tls_client_ca_file=" + path("ca.pem"),
            "--admin_token_file=" + path("token")).start()

    @classmethod
    def tearDownClass(cls):
        code = cls.server.stop()
        cls.directory.cleanup()
        if code != 0:
            raise AssertionError("TLS server exit code %s" % code)

    async def test_async_load_needs_the_token(self):
        async with AsyncAttentionClient(self.server.target, **self.tls) as client:
            self.assertEqual(await client.health(), "SERVING")
            with self.assertRaises(grpc.RpcError) as caught:
                await client.load_layer("t", CONFIG, random_seed=1)
            self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        async with AsyncAttentionClient(self.server.target, admin_token=self.token,
                                        **self.tls) as admin:
            self.assertEqual((await admin.load_layer("t", CONFIG, random_seed=1)).name, "t")
            await admin.unload_layer("t")

    def test_blocking_without_client_certificate_is_refused(self):
        with AttentionClient(self.server.target, tls_ca_file=self.tls["tls_ca_file"]) as c:
            with self.assertRaises(grpc.RpcError) as caught:
                c.list_layers(timeout=30)
            self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE)
        with AttentionClient(self.server.target, admin_token=self.token, **self.tls) as admin:
            self.assertEqual(admin.load_layer("u", CONFIG, random_seed=2).name, "u")
            admin.unload_layer("u")

    def test_server_name_is_checked(self):
        with AttentionClient(self.server.target, tls_server_name="localhost", **self.tls) as c:
            self.assertEqual(c.health(), "SERVING")
        with AttentionClient(self.server.target, tls_server_name="not-in-the-certificate",
                             **self.tls) as c:
            with self.assertRaises(grpc.RpcError) as caught:
                c.health()
            self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    unittest.main()
