"""The merged output loads with transformers' from_pretrained (no missing / unexpected keys) and
computes the same logits as a model built from the fixture's config with expected.safetensors."""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from e2e_util import expected_base, load_st, verl_name  # noqa: E402

LOAD_FIXTURES = [
    "qwen2_fsdp2_w2",                 # qwen2, tied
    "llama_fsdp2_w4",                 # llama, untied
    "qwen2_hsdp_2x2",                 # HSDP
    "qwen2_fsdp1_w2",                 # FSDP1 + device mesh
    "qwen2_fsdp1_sharded_tensor_w2",  # FSDP1 ShardedTensor (verl cannot merge it)
    "qwen2_fsdp2_tp_2x2",             # FSDP2 + TP (verl cannot merge it)
    "qwen2_critic_fsdp2_w2",          # critic: token classification under a CausalLM config
]
INPUT_IDS = [[2, 17, 45, 100, 200, 250, 3, 1, 0, 77, 128, 5]]
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)


def fixture_entry(manifest, name):
    fx = next((f for f in manifest["fixtures"] if f["name"] == name), None)
    if fx is None:
        pytest.skip(f"{name} not in the manifest")
    return fx


def model_class(fx):
    return (transformers.AutoModelForTokenClassification if fx["architecture"].endswith("ForTokenClassification")
            else transformers.AutoModelForCausalLM)


def load_kwargs(fx):
    return {"num_labels": 1} if fx["architecture"].endswith("ForTokenClassification") else {}


def reference_model(fixtures, fx, dtype=torch.bfloat16):
    """Model from the fixture's huggingface/config.json with expected.safetensors (verl names),
    cast to bf16 exactly as the merge casts it."""
    cls = model_class(fx)
    config = transformers.AutoConfig.from_pretrained(str(fixtures / fx["role_dir"] / "huggingface"),
                                                     **load_kwargs(fx))
    torch.manual_seed(0)
    model = cls.from_config(config, dtype=dtype)
    exp = {verl_name(k): v.to(torch.bfloat16).to(dtype)
           for k, v in load_st(fixtures / fx["expected"]).items() if "lora_" not in k}
    missing, unexpected = model.load_state_dict(exp, strict=False)
    assert not unexpected, f"reference: unexpected {unexpected}"
    tied_ok = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(missing) <= tied_ok, f"reference: missing {missing}"
    return model.eval()


def assert_clean_loading_info(info, where):
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), f"{where}: {key} = {info.get(key)}"


def logits(model):
    with torch.no_grad():
        return model(input_ids=torch.tensor(INPUT_IDS)).logits.float()


@pytest.mark.parametrize("name", LOAD_FIXTURES)
def test_from_pretrained_and_logits(name, manifest, fixtures, merged):
    fx = fixture_entry(manifest, name)
    out = merged(fx)
    cls = model_class(fx)
    model, info = cls.from_pretrained(str(out), output_loading_info=True, **load_kwargs(fx))
    assert_clean_loading_info(info, f"{cls.__name__}.from_pretrained({name} merged)")
    assert model.dtype == torch.bfloat16, f"config.json says bfloat16, model loaded as {model.dtype}"
    # every weight equals the expected one (catches a load that silently re-initialised something)
    exp = expected_base(fixtures, fx, "bf16", drop_tied=False)
    sd = model.state_dict()
    for k, t in exp.items():
        assert k in sd, f"{k} not in the loaded model"
        assert torch.equal(sd[k], t), f"{k}: loaded weight differs from expected (bf16)"
    got = logits(model.eval())
    ref = logits(reference_model(fixtures, fx))
    assert got.shape == ref.shape
    assert torch.isfinite(got).all()
    assert torch.allclose(got, ref, **BF16_TOL), f"{name}: max abs logit diff {(got - ref).abs().max().item():g}"
    # the same in fp32 compute: bf16 weights upcast exactly, so logits agree tightly
    model32 = cls.from_pretrained(str(out), dtype=torch.float32, **load_kwargs(fx)).eval()
    got32, ref32 = logits(model32), logits(reference_model(fixtures, fx, torch.float32))
    assert torch.allclose(got32, ref32, rtol=1e-5, atol=1e-5), \
        f"{name} fp32: max abs logit diff {(got32 - ref32).abs().max().item():g}"


def test_critic_as_causal_lm_is_documented(manifest, fixtures, merged):
    """The critic's config (as verl writes it) keeps architectures=[Qwen2ForCausalLM]; its
    weights are a token-classification model (score.*). AutoModelForCausalLM loads it with
    score.* unexpected (and lm_head tied to the embedding); AutoModelForTokenClassification
    with num_labels=1 loads it cleanly (test above). Same as verl's output."""
    fx = fixture_entry(manifest, "qwen2_critic_fsdp2_w2")
    out = merged(fx)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"], cfg["architectures"]
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert set(info["unexpected_keys"]) == {"score.weight", "score.bias"}, info
    assert not info["missing_keys"], info


def test_sharded_output_loads(manifest, fixtures, merged):
    fx = fixture_entry(manifest, "llama_fsdp2_w4")
    out = merged(fx, "--max-shard-size", "20KB")
    assert (out / "model.safetensors.index.json").exists()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert_clean_loading_info(info, "sharded llama")
    got, ref = logits(model.eval()), logits(reference_model(fixtures, fx))
    assert torch.allclose(got, ref, **BF16_TOL), f"max abs logit diff {(got - ref).abs().max().item():g}"


def test_tokenizer_loads(manifest, fixtures, merged):
    fx = fixture_entry(manifest, "qwen2_fsdp2_w2")
    out = merged(fx)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    src = transformers.AutoTokenizer.from_pretrained(str(fixtures / fx["role_dir"] / "huggingface"))
    text = "hello world <|im_start|>"
    assert tok(text)["input_ids"] == src(text)["input_ids"]
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == src.apply_chat_template(msgs, tokenize=False)
