"""Checkpoints of a private run, resumed bit-exactly.

* :mod:`~opacus_dp.checkpoints.file_format`: the safe file format (``weights_only`` loading,
  atomic writes, optional HMAC signature);
* :mod:`~opacus_dp.checkpoints.consistency`: the checks that a checkpoint's privacy state agrees
  with itself and with the run it is loaded into;
* :mod:`~opacus_dp.checkpoints.single_file`: one file (``PrivacyEngine.save_checkpoint``);
* :mod:`~opacus_dp.checkpoints.sharded`: a directory written by every rank of an FSDP2 run, with
  the ranks' agreement (:mod:`~opacus_dp.checkpoints.agreement`) and the directory's atomic
  replacement (:mod:`~opacus_dp.checkpoints.directory`).

The package imports nothing itself, so that each part can be imported alone.
"""
