"""The snapshot shelf: sharded snapshots in node-local shared memory that outlive their worker."""

import torch

from baige_ray.elastic.shelf import SnapshotShelf, read_shelf, shelf_directory, shelf_steps
from baige_ray.parallel.boxes import Box
from baige_ray.parallel.shards import ShardedPart, meta_part


def _part(value: float) -> ShardedPart:
    state = {"model": {"w": torch.full((3, 5), value), "b": torch.full((7,), value, dtype=torch.bfloat16)},
             "optimizer": {"w": {"step": torch.tensor(value), "exp_avg": torch.full((3, 5), -value),
                                 "exp_avg_sq": torch.full((3, 5), value * 2)}}}
    return ShardedPart(state, {"w": Box((6, 5), (3, 0), (3, 5)), "b": Box((14,), (7,), (7,), flat=True)})


def _equal(a: ShardedPart, b: ShardedPart) -> bool:
    return a.boxes == b.boxes and all(torch.equal(a.state["model"][n], b.state["model"][n]) for n in a.state["model"]) \
        and all(torch.equal(a.state["optimizer"]["w"][k], b.state["optimizer"]["w"][k]) for k in a.state["optimizer"]["w"])


def test_a_shelf_keeps_its_two_newest_snapshots_readable_by_another_process_after_its_writer_is_gone(tmp_path):
    shelf = SnapshotShelf(tmp_path / "w", slots=2)
    assert shelf.begin() is None  # nothing mapped yet: the engine allocates the first time
    shelf.commit(0, _part(1.0))
    into = shelf.begin()
    assert into is None  # the second slot is new too
    shelf.commit(1, _part(2.0))
    into = shelf.begin()  # slot of step 0: written over in place from now on
    assert torch.equal(into.state["model"]["w"], torch.full((3, 5), 1.0))
    into.state["model"]["w"].fill_(3.0)
    into.state["model"]["b"].fill_(3.0)
    into.state["optimizer"]["w"]["step"].fill_(3.0)
    into.state["optimizer"]["w"]["exp_avg"].fill_(-3.0)
    into.state["optimizer"]["w"]["exp_avg_sq"].fill_(6.0)
    stored = shelf.commit(2, into)
    assert stored.state["model"]["w"].data_ptr() == into.state["model"]["w"].data_ptr()
    del shelf  # the writer is gone; its files stay
    assert shelf_steps(tmp_path / "w") == [2, 1]
    step, part = read_shelf(tmp_path / "w")
    assert step == 2 and _equal(part, _part(3.0))
    assert _equal(read_shelf(tmp_path / "w", step=1)[1], _part(2.0))


def test_a_slot_being_written_is_not_read_so_a_worker_killed_mid_copy_leaves_the_older_one(tmp_path):
    two = SnapshotShelf(tmp_path / "two", slots=2)
    two.commit(0, _part(1.0))
    two.commit(1, _part(2.0))
    two.begin()  # writing step 2 over step 0's slot, then killed
    assert shelf_steps(tmp_path / "two") == [1]
    assert read_shelf(tmp_path / "two")[0] == 1
    one = SnapshotShelf(tmp_path / "one", slots=1)
    one.commit(0, _part(1.0))
    one.begin()  # one slot: a copy killed midway leaves nothing whole
    assert read_shelf(tmp_path / "one") is None


def test_a_restarted_shelf_resumes_after_its_newest_slot_and_removes_its_files(tmp_path):
    shelf = SnapshotShelf(tmp_path / "w")
    shelf.commit(4, _part(1.0))
    again = SnapshotShelf(tmp_path / "w")
    again.begin()
    again.commit(5, _part(2.0))
    assert shelf_steps(tmp_path / "w") == [5, 4]
    again.remove()
    assert not (tmp_path / "w").exists()
    assert shelf_directory("baige-worker:my run:ab12", tmp_path) == tmp_path / "my_run" / "ab12"


def test_a_layout_lays_the_slot_out_before_the_first_copy_so_the_engine_writes_straight_into_it(tmp_path):
    shelf = SnapshotShelf(tmp_path / "w", slots=1)
    layout = meta_part(_part(0.0).state, _part(0.0).boxes)
    into = shelf.begin(layout)
    assert into.state["model"]["w"].device.type == "cpu" and into.state["model"]["b"].dtype == torch.bfloat16
    for tensor in (into.state["model"]["w"], into.state["model"]["b"], *into.state["optimizer"]["w"].values()):
        tensor.fill_(4.0)
    stored = shelf.commit(0, into)  # nothing left to copy
    assert stored.state["model"]["w"].data_ptr() == into.state["model"]["w"].data_ptr()
    assert read_shelf(tmp_path / "w")[1].state["optimizer"]["w"]["exp_avg"].eq(4.0).all()
    assert len(list((tmp_path / "w").glob("*.bin"))) == 1


def test_a_part_read_from_a_shelf_crosses_processes_at_its_own_size(tmp_path):
    """Its tensors are views of one mapped file; pickled one by one, torch would write the whole file once
    per tensor (a reading worker then spent seconds in pickle and missed its heartbeats)."""
    from ray import cloudpickle

    big = _part(1.0)
    big.state["model"]["big"] = torch.arange(2**18, dtype=torch.float32)  # 1 MiB of the file
    big.boxes["big"] = Box((2**19,), (0,), (2**18,), flat=True)
    shelf = SnapshotShelf(tmp_path / "w", slots=1)
    shelf.commit(4, big)
    _, read = read_shelf(tmp_path / "w")
    pickled = cloudpickle.dumps(read)
    assert len(pickled) < 1.2 * read.nbytes
    back = cloudpickle.loads(pickled)
    assert _equal(back, big) and torch.equal(back.state["model"]["big"], big.state["model"]["big"])
    assert back.state["optimizer"]["w"]["step"].shape == () and back.state["model"]["b"].dtype == torch.bfloat16
