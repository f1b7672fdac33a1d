"""Dataset sources: every local kind of `--dataset` source, OpenRLHF's mixing and caps, located errors."""

import json

import pytest

from rlhf.data.sources import Row, interleave_order, read_rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def ids(rows):
    return [r.data["id"] for r in rows]


def read(dataset, probs=None, split="train", max_samples=10**6, seed=42, flag="--dataset"):
    return read_rows(dataset, probs=probs, split=split, max_samples=max_samples, seed=seed, flag=flag)


def numbered(prefix, n):
    return [{"id": f"{prefix}{i}"} for i in range(n)]


def test_jsonl_file_rows_carry_file_and_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1}\n\n{"id": 2}\n')
    rows = read(str(path))
    assert rows == [Row(str(path), 1, {"id": 1}), Row(str(path), 2, {"id": 2})]
    assert rows[1].where == f"{path}, row 2"


def test_json_list_data_member_and_json_lines_in_a_json_file(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(numbered("a", 2)))
    (tmp_path / "b.json").write_text(json.dumps({"data": numbered("b", 2)}))
    (tmp_path / "c.json").write_text('{"id": "c0"}\n{"id": "c1"}\n')
    assert ids(read(",".join(str(tmp_path / f) for f in ("a.json", "b.json", "c.json")))) == \
        ["a0", "a1", "b0", "b1", "c0", "c1"]


def test_directory_prefers_split_named_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", numbered("t", 2))
    write_jsonl(tmp_path / "test.jsonl", numbered("e", 1))
    assert ids(read(str(tmp_path))) == ["t0", "t1"]
    assert ids(read(str(tmp_path), split="test")) == ["e0"]
    with pytest.raises(ValueError, match=r"--eval_dataset .*: no files for split 'validation' \(files are named "
                                         r"for other splits: test.jsonl, train.jsonl\)"):
        read(str(tmp_path), split="validation", flag="--eval_dataset")


def test_directory_without_split_names_reads_every_file_in_order(tmp_path):
    write_jsonl(tmp_path / "part1.jsonl", numbered("p", 2))
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "more.jsonl", numbered("q", 1))
    (tmp_path / "notes.txt").write_text("not data")
    assert ids(read(str(tmp_path), split="test")) == ["p0", "p1", "q0"]


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_parquet_file_and_directory(tmp_path):
    pytest.importorskip("pyarrow")
    rows = [{"id": "x0", "messages": [{"role": "user", "content": "hi"}]}, {"id": "x1", "messages": []}]
    path = write_parquet(tmp_path / "one.parquet", rows)
    got = read(path)
    assert [r.data for r in got] == rows and got[1].where == f"{path}, row 2"
    folder = tmp_path / "pq"
    (folder / "data").mkdir(parents=True)
    write_parquet(folder / "data" / "train-00000-of-00002.parquet", numbered("a", 2))
    write_parquet(folder / "data" / "train-00001-of-00002.parquet", numbered("b", 1))
    write_parquet(folder / "data" / "test-00000-of-00001.parquet", numbered("c", 1))
    assert ids(read(str(folder))) == ["a0", "a1", "b0"]
    assert ids(read(f"parquet@{folder}", split="test")) == ["c0"]


def test_json_at_and_parquet_at_pick_one_kind_of_a_mixed_directory(tmp_path):
    pytest.importorskip("pyarrow")
    write_jsonl(tmp_path / "train.jsonl", numbered("j", 2))
    write_parquet(tmp_path / "train.parquet", numbered("p", 1))
    assert ids(read(f"json@{tmp_path}")) == ["j0", "j1"]
    assert ids(read(f"parquet@{tmp_path}")) == ["p0"]
    with pytest.raises(ValueError, match=r"both JSON and parquet files; pick one kind with json@"):
        read(str(tmp_path))
    with pytest.raises(ValueError, match=r"--dataset json@/no/such/dir: /no/such/dir is not a directory"):
        read("json@/no/such/dir")


def test_dir_at_subdir_reads_that_subdirectory(tmp_path):
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "train.jsonl", numbered("s", 1))
    write_jsonl(tmp_path / "train.jsonl", numbered("top", 1))
    assert ids(read(f"{tmp_path}@sub")) == ["s0"]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(numbered("d", 3)).save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(numbered("t", 2)),
                          "test": datasets.Dataset.from_list(numbered("e", 1))}).save_to_disk(str(tmp_path / "dict"))
    plain = read(str(tmp_path / "plain"), max_samples=2)
    assert ids(plain) == ["d0", "d1"] and plain[0].where == f"{tmp_path / 'plain'}, row 1"
    test = read(str(tmp_path / "dict"), split="test")
    assert ids(test) == ["e0"] and test[0].where == f"{tmp_path / 'dict'} [test], row 1"
    with pytest.raises(ValueError, match=r"saved dataset has no split 'dev' \(splits: train, test\)"):
        read(str(tmp_path / "dict"), split="dev")


def test_concatenation_and_max_samples_cap_the_total(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered("a", 3))
    b = write_jsonl(tmp_path / "b.jsonl", numbered("b", 2))
    assert ids(read(f"{a}, {b}")) == ["a0", "a1", "a2", "b0", "b1"]
    assert ids(read(f"{a},{b}", max_samples=4)) == ["a0", "a1", "a2", "b0"]
    assert ids(read(f"{a},{b}", max_samples=2)) == ["a0", "a1"]


def hf_interleave(sources, probs, seed, max_samples):
    """What OpenRLHF's blending_datasets returns: per-source cap, HF interleave, total cap."""
    datasets = pytest.importorskip("datasets")
    parts = [datasets.Dataset.from_list(rows[:max_samples]) for rows in sources]
    mixed = datasets.interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
    return mixed.select(range(min(max_samples, len(mixed))))["id"]


@pytest.mark.parametrize("sizes,probs,seed,max_samples", [
    ((20, 5), (0.5, 0.5), 42, 10**6),
    ((7, 30, 3), (0.2, 0.7, 0.1), 0, 10**6),
    ((400, 10), (0.9, 0.1), 3, 10**6),
    ((50, 8), (0.3, 0.7), 1, 12),   # caps each source, then the mix
])
def test_probs_mixing_equals_openrlhf_blending(tmp_path, sizes, probs, seed, max_samples):
    sources = [numbered(chr(ord("a") + i), n) for i, n in enumerate(sizes)]
    paths = [write_jsonl(tmp_path / f"s{i}.jsonl", rows) for i, rows in enumerate(sources)]
    got = read(",".join(paths), probs=",".join(map(str, probs)), seed=seed, max_samples=max_samples)
    assert ids(got) == hf_interleave(sources, list(probs), seed, max_samples)


def test_mixing_counts_by_hand():
    # all_exhausted: draws stop right after every source has given its last row; a source drawn more
    # often than it has rows starts over from its first row
    order = interleave_order([3, 1], [0.5, 0.5], seed=0)
    rows_of = {k: [row for source, row in order if source == k] for k in (0, 1)}
    assert rows_of[0] == [i % 3 for i in range(len(rows_of[0]))] and len(rows_of[0]) >= 3
    assert rows_of[1] == [0] * len(rows_of[1]) and len(rows_of[1]) >= 1
    last_source, last_row = order[-1]
    assert (last_source, last_row) in ((0, 2), (1, 0))
    assert len(rows_of[last_source]) == (3 if last_source == 0 else 1)  # its first pass just ended


def test_mixing_is_deterministic_in_the_seed(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered("a", 30))
    b = write_jsonl(tmp_path / "b.jsonl", numbered("b", 30))
    first = ids(read(f"{a},{b}", probs="0.5,0.5", seed=1))
    assert first == ids(read(f"{a},{b}", probs="0.5,0.5", seed=1))
    assert first != ids(read(f"{a},{b}", probs="0.5,0.5", seed=2))


def test_missing_file_and_hub_names(tmp_path):
    with pytest.raises(ValueError, match=r"--dataset .*nope.jsonl: no such file or directory \(hub names are not "
                                         r"downloaded"):
        read(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match=r"--eval_dataset Anthropic/hh-rlhf: no such file.*looks like a Hugging Face "
                                         r"Hub dataset: download it"):
        read("Anthropic/hh-rlhf", flag="--eval_dataset")


def test_bad_json_is_located(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1}\n{"id": \n')
    with pytest.raises(ValueError, match=r"d.jsonl, line 2: not valid JSON"):
        read(str(path))
    whole = tmp_path / "d.json"
    whole.write_text('[{"id": 1},\n {"id": }]')
    with pytest.raises(ValueError, match=r"d.json: not valid JSON \(.* at line 2\)"):
        read(str(whole))
    rows = tmp_path / "r.jsonl"
    rows.write_text('{"id": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"r.jsonl, row 2: expected an object of named columns, got list"):
        read(str(rows))


def test_unsupported_file_and_empty_directory(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("id\n1\n")
    with pytest.raises(ValueError, match=r"--dataset .*d.csv: unsupported file type '.csv'"):
        read(str(csv))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: directory has no JSON/JSONL or parquet files"):
        read(str(tmp_path / "empty"))


def test_probs_errors_name_both_flags_and_the_fix(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered("a", 3))
    b = write_jsonl(tmp_path / "b.jsonl", numbered("b", 3))
    with pytest.raises(ValueError, match=r"--dataset_probs 0.5,0.3,0.2: 3 probabilities for 2 sources in --dataset; "
                                         r"give one per source"):
        read(f"{a},{b}", probs="0.5,0.3,0.2")
    with pytest.raises(ValueError, match=r"--prompt_data_probs 0.5,0.6: probabilities sum to 1.1, not 1; rescale"):
        read(f"{a},{b}", probs="0.5,0.6", flag="--prompt_data")
    with pytest.raises(ValueError, match=r"--dataset_probs 1,0: every probability must be > 0"):
        read(f"{a},{b}", probs="1,0")
    with pytest.raises(ValueError, match=r"--dataset_probs a,b: not a comma-separated list of numbers"):
        read(f"{a},{b}", probs="a,b")
    with pytest.raises(ValueError, match=r"--dataset .*: empty source name"):
        read(f"{a},,{b}")


def test_bytes_that_are_not_utf8_name_the_file_line_and_byte_offset(tmp_path, capsys):
    from rlhf.config.errors import UsageError, usage_errors_exit

    good = '{"id": "caf\u00e9 \u2028 ok"}\n'.encode()  # non-ASCII UTF-8, and a line separator JSON allows in strings
    bad = '{"id": "caf\u00e9"}\n'.encode("latin-1")  # é as the single byte 0xe9
    (tmp_path / "good.jsonl").write_bytes(good + good)
    assert ids(read(str(tmp_path / "good.jsonl"))) == ["caf\u00e9 \u2028 ok"] * 2
    lines = tmp_path / "d.jsonl"
    lines.write_bytes(good + good + bad)
    offset = 2 * len(good) + bad.index(b"\xe9")
    with pytest.raises(UsageError, match=rf"d.jsonl, line 3: not UTF-8 text \(byte 0xe9 at byte offset {offset}: "):
        read(str(lines))
    listed = tmp_path / "d.json"
    listed.write_bytes(b'[\n  {"id": 1},\n  {"id": "\xff"}\n]\n')
    with pytest.raises(UsageError, match=r"d.json, line 3: not UTF-8 text \(byte 0xff at byte offset 25: "):
        read(str(listed))
    with pytest.raises(SystemExit) as exit_info, usage_errors_exit():
        read(str(lines))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {lines}, line 3: not UTF-8 text (byte 0xe9 at byte offset {offset}: invalid continuation " \
        f"byte); re-encode the file as UTF-8 from the encoding it was written in (e.g. `iconv -f latin1 -t utf-8 " \
        f"{lines}`)\n"
