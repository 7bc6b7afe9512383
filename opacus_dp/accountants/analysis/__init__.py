"""Privacy analysis behind the accountants: RDP (``rdp``), Gaussian DP (``gdp``) and grid
privacy loss distributions composed by FFT (``prv``)."""
