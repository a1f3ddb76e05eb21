"""hivemind's DHT node, reading each command from its host whole (``client.helper_processes.receive_whole``): a store
of a 40 KB value otherwise lost about one call in three, its caller waiting for ever, and ended the node
(``tests/pipeline/test_dht_node.py``)."""

from __future__ import annotations

import hivemind

from client.helper_processes import receive_whole


class DHTNode(hivemind.DHT):
    """``hivemind.DHT`` whose process receives every command whole, however large."""

    def run(self) -> None:
        receive_whole(self._inner_pipe)
        super().run()
