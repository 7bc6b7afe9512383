"""``python -m opacus_dp.scripts.compute_dp_sgd_privacy``: Opacus 0.x's command line."""

from opacus_dp.compat.dp_sgd_privacy import main

if __name__ == "__main__":
    main()
