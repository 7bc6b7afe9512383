"""Counter-based Gaussian noise: Philox4x32-10 and Box-Muller, native (``kernel.c``) or torch (``reference``)."""
