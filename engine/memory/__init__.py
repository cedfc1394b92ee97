"""Who owns device memory: ``DeviceOwner``, the only release path (reverse order of creation,
the reachability check), and weights moved in place (offload to host, restore, validated
updates)."""
