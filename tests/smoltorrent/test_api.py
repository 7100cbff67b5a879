"""smoltorrent.save / smoltorrent.load on a real cluster: real Redis, nodes and worker."""

from __future__ import annotations

from tests.smoltorrent.conftest import ROOT, ApiSession, run_api


def test_torch_round_trip_is_bit_exact_with_bf16_fp8_tied_and_transposed(make_cluster, api_session):
    c = make_cluster(4)
    api = api_session(c)  # both scripts in one API process (one import of torch)
    out = api.run(
        """
        import json
        import safetensors.torch
        import smoltorrent
        from tests.checkpoints import llm_like_tensors

        sd = llm_like_tensors(layers=2, hidden=32)
        saved = smoltorrent.save(sd, "api/torch.safetensors", metadata={"step": "7"})
        back = smoltorrent.load("api/torch.safetensors", source="cluster")
        print(json.dumps({
            "version_id": saved.version_id,
            "new": saved.new,
            "same_bytes": safetensors.torch.save(sd) == safetensors.torch.save(back),
            "dtypes": sorted({str(t.dtype) for t in back.values()}),
        }))
        """,
    )
    assert out["same_bytes"] and out["new"]
    assert {"torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2"} <= set(out["dtypes"])
    listed = [v for v in c.cli_json("ls") if v["name"] == "api/torch.safetensors"]
    assert [v["version_id"] for v in listed] == [out["version_id"]]
    assert listed[0]["state"] == "committed" and listed[0]["min_copies"] == 2
    # The staged local copy has moved to the local tier once the version is committed.
    assert list((c.root / "staging").glob("*.safetensors")) == []
    assert len(list((c.root / "staging" / "local").glob("*.safetensors"))) == 1

    # An LLM's state dict often ties lm_head.weight to the embeddings (one tensor under
    # two names), and may hold a transposed view: safetensors refuses both, so save() failed
    # on them. Each name now comes back with its exact values.
    out = api.run(
        """
        import json
        import torch
        import smoltorrent

        embed = torch.randn(64, 16)
        w = torch.randn(8, 4)
        sd = {"embed.weight": embed, "lm_head.weight": embed, "proj.weight": w.t(),
              "first_rows": embed[:2]}
        smoltorrent.save(sd, "api/tied.safetensors")
        back = smoltorrent.load("api/tied.safetensors")
        print(json.dumps({k: torch.equal(back[k], v) for k, v in sd.items()}
                         | {"keys": sorted(back) == sorted(sd)}))
        """
    )
    assert all(out.values()), out


def test_numpy_and_mlx_round_trips_keep_bf16_and_fp8_bits(make_cluster, api_session):
    c = make_cluster(3)
    api = api_session(c)  # both scripts in one API process
    out = api.run(
        """
        import json
        import ml_dtypes
        import numpy as np
        import safetensors.numpy
        import smoltorrent

        rng = np.random.default_rng(0)
        f32 = rng.standard_normal((17, 9)).astype(np.float32)
        sd = {
            "w_bf16": f32.astype(ml_dtypes.bfloat16),
            "w_e4m3": f32.astype(ml_dtypes.float8_e4m3fn),
            "w_e5m2": f32.astype(ml_dtypes.float8_e5m2),
            "w_f32": f32,
            "w_i64": np.arange(5, dtype=np.int64),
            "flags": f32[0] > 0,
            "scalar": np.array(2.5, dtype=np.float64),
            "empty": np.zeros((0, 4), dtype=np.float16),
        }
        smoltorrent.save(sd, "api/numpy.safetensors", replicas=2)
        back = smoltorrent.load("api/numpy.safetensors", framework="numpy")
        print(json.dumps({
            "same_bytes": safetensors.numpy.save(sd) == safetensors.numpy.save(back),
            "dtypes": {k: str(v.dtype) for k, v in back.items()},
        }))
        """,
    )
    assert out["same_bytes"]
    assert out["dtypes"]["w_bf16"] == "bfloat16" and out["dtypes"]["w_e4m3"] == "float8_e4m3fn"

    # mlx, and fp8 saved from torch loaded as mlx (its bits, as uint8).
    out = api.run(
        """
        import json
        import mlx.core as mx
        import numpy as np
        import torch
        import smoltorrent

        def raw(a):
            return np.array(a.reshape(-1).view(mx.uint8)).tobytes().hex()

        sd = {
            "w_bf16": (mx.arange(24, dtype=mx.float32) / 7).astype(mx.bfloat16).reshape(4, 6),
            "w_f16": mx.ones((3,), dtype=mx.float16),
            "w_i32": mx.array([1, -2, 3], dtype=mx.int32),
            "flags": mx.array([True, False]),
            "scalar": mx.array(3.25),
        }
        smoltorrent.save(sd, "api/mlx.safetensors")
        back = smoltorrent.load("api/mlx.safetensors", framework="mlx")
        fp8 = torch.linspace(-3, 3, 16).to(torch.float8_e4m3fn)
        smoltorrent.save({"fp8": fp8}, "api/fp8.safetensors")
        as_mlx = smoltorrent.load("api/fp8.safetensors", framework="mlx")["fp8"]
        print(json.dumps({
            "same": sorted(sd) == sorted(back)
            and all(sd[k].dtype == back[k].dtype and sd[k].shape == back[k].shape
                    and raw(sd[k]) == raw(back[k]) for k in sd),
            "fp8_dtype": str(as_mlx.dtype),
            "fp8_bits": raw(as_mlx) == fp8.view(torch.uint8).numpy().tobytes().hex(),
        }))
        """,
    )
    assert out == {"same": True, "fp8_dtype": "mlx.core.uint8", "fp8_bits": True}


def test_async_save_returns_a_handle_and_saves_of_one_name_run_in_order(make_cluster):
    c = make_cluster(3)
    out = run_api(
        c,
        """
        import json
        import torch
        import smoltorrent

        first = smoltorrent.save({"w": torch.full((64, 64), 1.0)}, "api/latest", wait=False)
        second = smoltorrent.save({"w": torch.full((64, 64), 2.0)}, "api/latest", wait=False)
        returned_early = not first.done() and not second.done()
        a, b = first.result(timeout=120), second.result(timeout=120)
        back = smoltorrent.load("api/latest")["w"]
        print(json.dumps({
            "returned_early": returned_early,
            "ids": [a.version_id, b.version_id, second.version_id],
            "current_is_second": bool((back == 2.0).all()),
        }))
        """,
    )
    assert out["returned_early"] and out["current_is_second"]
    first_id, second_id, again = out["ids"]
    assert first_id != second_id == again
    versions = [v for v in c.cli_json("ls") if v["name"] == "api/latest"]
    assert {v["version_id"] for v in versions} == {first_id, second_id}
    assert all(v["state"] == "committed" for v in versions)
    # In order: the second store planned only once the first had committed.
    by_id = {v["version_id"]: c.md.versions.version(v["vkey"]) for v in versions}
    assert float(by_id[first_id]["committed_at"]) <= float(by_id[second_id]["created_at"])
    current = [v for v in versions if v["current"]]
    assert [v["version_id"] for v in current] == [second_id]


def test_bad_input_is_refused_before_anything_is_stored(make_cluster):
    c = make_cluster(2)
    out = run_api(
        c,
        """
        import json
        import mlx.core as mx
        import torch
        import smoltorrent
        from smoltorrent.errors import SmoltorrentError, StateDictError

        errors = {}
        for label, call in {
            "not_tensor": lambda: smoltorrent.save({"lr": {1, 2}}, "bad"),
            "mixed": lambda: smoltorrent.save({"a": torch.ones(1), "b": mx.ones(1)}, "bad"),
            "metadata": lambda: smoltorrent.save({"a": torch.ones(1)}, "bad", metadata={"k": 1}),
            "framework": lambda: smoltorrent.load("bad", framework="jax"),
            "missing": lambda: smoltorrent.load("never/stored"),
            "name": lambda: smoltorrent.save({"a": torch.ones(1)}, "bad\\nname"),
        }.items():
            try:
                call()
            except SmoltorrentError as exc:
                errors[label] = [isinstance(exc, StateDictError), str(exc)]
        print(json.dumps(errors))
        """,
    )
    assert set(out) == {"not_tensor", "mixed", "metadata", "framework", "missing", "name"}
    assert all(out[k][0] for k in ("not_tensor", "mixed", "metadata", "framework"))
    assert "'lr' is a builtins.set" in out["not_tensor"][1]
    assert "never/stored" in out["missing"][1]
    assert "'bad\\nname' holds a control character" in out["name"][1]
    assert [v for v in c.cli_json("ls") if v["name"] == "bad"] == []
    assert list((c.root / "staging").glob("*.safetensors")) == []


def test_the_readme_example_runs(make_cluster):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## From a training loop", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    c = make_cluster(2)
    check = """
import json
live, saved = optimizer.state_dict()["state"], state["optim"]["state"]
print(json.dumps({
    "first_step": first_step,
    "model": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                   state["model"].values(), strict=True)),
    "optim": all(torch.equal(live[p][k], saved[p][k]) for p in live for k in live[p]),
    "sched": state["sched"]["last_epoch"],
}))
"""
    out = run_api(c, example + check)
    # The resumed model, AdamW moments and scheduler are the ones saved at step 300.
    assert out == {"first_step": 301, "model": True, "optim": True, "sched": 300}
    # Three saves of a training state, each with its own step: three versions.
    rows = [v for v in c.cli_json("ls") if v["name"] == "run1/latest"]
    assert [v["state"] for v in rows] == ["committed"] * 3


def test_load_reads_name_at_label_and_name_at_version(make_cluster):
    """`gather NAME@LABEL` read the tagged version, but `smoltorrent.load("NAME@LABEL")`
    looked for a checkpoint named "NAME@LABEL" and found none."""
    from tests.coordinator.cli.test_papercuts import run

    c = make_cluster(2)
    # One API process for the saves and every load (one import of the API), the tag
    # between them from the CLI.
    with ApiSession(c) as api:
        first, second = api.run(
            """
            import json
            import numpy as np
            import smoltorrent

            ids = [
                smoltorrent.save({"w": np.full(64, step, np.float32)}, "api/at.safetensors")
                .version_id
                for step in (1.0, 2.0)
            ]
            print(json.dumps(ids))
            """
        )
        tagged = run("tag", "api/at.safetensors", first[:12], "best", env=c.env())
        assert tagged.returncode == 0, tagged.stderr
        out = api.run(
            f"""
            import json
            import smoltorrent

            def w(name):
                return float(smoltorrent.load(name, framework="numpy")["w"][0])

            print(json.dumps([
                w("api/at.safetensors"),
                w("api/at.safetensors@best"),
                w("api/at.safetensors@{first[:12]}"),
                w("api/at.safetensors@{second}"),
            ]))
            """
        )
        assert out == [2.0, 1.0, 1.0, 2.0]
        ok, _, err = api.run(
            """
            import smoltorrent
            smoltorrent.load("api/at.safetensors@worst", framework="numpy")
            """,
            check=False,
        )
    assert not ok
    assert "no version of api/at.safetensors is tagged 'worst'" in err
