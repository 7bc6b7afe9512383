"""scripts/count_host_reads.py: the host reads of one private step (each a wait for a GPU).

``bk`` with flat clipping reads its ghost norms' rounding checks in one batched read per step;
per-layer clipping and ``ghost``'s norms pass read them at every ghost-norm layer. Oracle: the
sequence model's ghost-norm layers (two ``Linear`` blocks of T = 128 positions, each checked)."""

from tests.script_loading import load_script


def test_flat_bk_reads_once_per_step_where_per_layer_clipping_reads_per_layer(capsys):
    module = load_script("count_host_reads.py", "count_host_reads")
    bk = module.count_reads("sequence", "bk", batch_size=2)
    per_layer = module.count_reads("sequence", "bk-per-layer", batch_size=2)
    assert bk == {"scalar": 1, "batched": 1}  # the non-finite screen, the deferred checks
    assert per_layer["batched"] == 0 and per_layer["scalar"] >= bk["scalar"] + 4  # ≥ 4 ghost-norm Linears
    module.main(["--models", "convnet", "--modes", "bk"])
    assert capsys.readouterr().out.splitlines()[1].split() == ["convnet", "bk", "1", "1"]
