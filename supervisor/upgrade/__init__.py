"""Outliving engined's own process: the upgrade in place (handover), adoption after a crash
(recovery) and the snapshot format both read."""
