"""The epochs of iterators set aside while another iterator runs."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple


class ParkedEpochs:
    """The in-flight state of iterators set aside while another iterator runs.

    A pipeline parks its in-flight batches (whatever state it keeps for them)
    when a different iterator is passed, and resumes them when the parked
    iterator comes back; see ``TrainPipelineSparseDist._switch_iterator``.
    """

    def __init__(self) -> None:
        self._parked: Dict[int, Tuple[Iterator[Any], Any]] = {}

    def park(self, iterator: Iterator[Any], state: Any) -> None:
        # The entry keeps the iterator alive, so its id() stays unique while parked.
        self._parked[id(iterator)] = (iterator, state)

    def resume(self, iterator: Iterator[Any]) -> Optional[Any]:
        entry = self._parked.pop(id(iterator), None)
        return entry[1] if entry is not None and entry[0] is iterator else None

    def states(self) -> List[Any]:
        return [state for _, state in self._parked.values()]

    def clear(self) -> None:
        self._parked.clear()
