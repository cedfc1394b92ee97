"""The in-process engine users hold: ``AsyncEngine`` (the anyio loop, the lifecycle owner, the
API), the request side (intake, admission checks and limits, request streams and their
mailboxes), the one step thread, sleep mode's controller and the CPU thread governor."""
