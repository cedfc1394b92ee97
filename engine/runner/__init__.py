"""``ModelRunner``: load -> execute one mixed step -> release. It owns every device resource
through its ``DeviceOwner``; sleep, wake and weight updates (``sleep``); a launched step's
result (``launched``); the collector kept off the startup heap (``gc_freeze``)."""
