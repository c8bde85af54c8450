"""The baseline MKOR is measured against in NumPy float64: K-FAC in its KAISA form, per
expert too (``kfac``). The first-order rules (LAMB among them) are common to every family:
``reference/common/first_order.py``."""
