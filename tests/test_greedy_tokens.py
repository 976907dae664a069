"""``benchmarks/greedy_tokens.py``: one setting's greedy tokens, and two runs compared (the GPU
check that a launch-only switch such as XLA's PDL leaves the outputs as they were)."""

from __future__ import annotations

import json

from jaxllm.benchmarks import greedy_tokens


def test_the_prompts_are_fixed_and_of_several_lengths():
    first, again = greedy_tokens.prompts(4, 512), greedy_tokens.prompts(4, 512)
    assert first == again
    assert [len(p) for p in first] == [24, 77, 130, 183]
    assert all(100 <= t < 512 for p in first for t in p)


def test_compare_counts_the_same_replies_and_where_the_others_part():
    a = {"tokens": [[1, 2, 3], [4, 5, 6], [7, 8]]}
    b = {"tokens": [[1, 2, 3], [4, 9, 6], [7, 8, 9]]}
    assert greedy_tokens.compare(a, a) == {"replies": 3, "same": 3, "first_difference": {}}
    # a reply cut short parts where the shorter one ends
    assert greedy_tokens.compare(a, b) == {"replies": 3, "same": 1,
                                           "first_difference": {1: 1, 2: 2}}


def test_a_run_and_its_comparison_end_to_end(tiny_config, tmp_path, capsys):
    args = ["--model", tiny_config, "--dtype", "float32", "--num-prompts", "3",
            "--max-tokens", "3"]
    for name in ("a", "b"):
        assert greedy_tokens.main([*args, "--output-json", str(tmp_path / f"{name}.json")]) == 0
    record = json.loads((tmp_path / "a.json").read_text())
    assert [len(t) for t in record["tokens"]] == [3, 3, 3]
    assert greedy_tokens.main(["--compare", str(tmp_path / "a.json"),
                               str(tmp_path / "b.json")]) == 0
    assert "3 of 3 replies the same" in capsys.readouterr().out
    changed = dict(record, tokens=[record["tokens"][0], [0, 0, 0], record["tokens"][2]])
    (tmp_path / "c.json").write_text(json.dumps(changed))
    assert greedy_tokens.main(["--compare", str(tmp_path / "a.json"),
                               str(tmp_path / "c.json")]) == 1
