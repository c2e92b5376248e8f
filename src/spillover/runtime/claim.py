"""What a job owns of the checkpoint it restores (``execution.state-recovery.claim-mode``)
and, for a claimed checkpoint outside the job's folder, its deletion once no retained
checkpoint references it. The job master composes one."""

from __future__ import annotations

import logging

from spillover.config import ClaimMode, Config
from spillover.errors import SpilloverError
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.metadata import CheckpointStorage, referenced_uris
from spillover.storage.location import Location, delete_tree

logger = logging.getLogger(__name__)


class CheckpointClaim:
    """The claim on the restored checkpoint of one job (none without checkpoint
    storage): whom it belongs to, and when a claimed foreign one is deleted."""

    def __init__(self, storage: CheckpointStorage | None, config: Config) -> None:
        self._storage = storage
        self._config = config
        # A claimed checkpoint outside the job's folder, deleted once unreferenced, and
        # how many completed checkpoints in a row have not referenced it.
        self._claimed: Location | None = None
        self._unreferenced = 0

    def claim(self, meta: CheckpointMetadata, asked: int | str) -> int | None:
        """Claims checkpoint ``meta``, restored as ``asked`` (an id in the job's
        checkpoint directory, or a checkpoint directory's path). NO_CLAIM: nothing; a
        checkpoint outside the job's checkpoint folder (a savepoint) is never
        deleted, and every checkpoint copies the files it references there, so none
        depends on it; one in the job's folder is never deleted either, and
        checkpoints reference its files as after a failover. CLAIM: retention
        deletes it, as one of the job's own checkpoints (in the job's folder: its id
        is returned, for retention to count it), or, elsewhere, once as many newer
        checkpoints as are retained completed without referencing it."""
        storage = self._storage
        if storage is None:
            return None
        chk = (
            Location.parse(asked)
            if isinstance(asked, str)
            else Location.parse(storage.checkpoint_dir(meta.checkpoint_id))
        )
        own = chk.parent.prefix == storage.location.prefix
        # A savepoint's folder holds the chk-<id> of its references beside its own.
        folder = chk.parent if not own and chk.parent.name.startswith("savepoint-") else chk
        if self._config.recovery.claim_mode is ClaimMode.NO_CLAIM:
            if not own:
                storage.copy_referenced_from = (folder,)
        elif own:
            return meta.checkpoint_id
        else:
            self._claimed, self._unreferenced = folder, 0
        return None

    def checkpoint_completed(self, checkpoint_id: int) -> None:
        """Deletes a claimed checkpoint outside the job's folder once the retained
        checkpoints no longer reference it; a failure is logged, never raised (the
        checkpoint that just completed must not fail for it)."""
        claimed, storage = self._claimed, self._storage
        if claimed is None:
            return
        assert storage is not None
        try:
            meta = storage.read(checkpoint_id)
            prefix = claimed.prefix + "/"
            if any(u.partition("?")[0].startswith(prefix) for u in referenced_uris(meta)):
                self._unreferenced = 0
                return
            self._unreferenced += 1
            if self._unreferenced >= self._config.state.num_retained:
                self._claimed = None
                delete_tree(claimed, "claimed checkpoint")
                logger.info("deleted the claimed checkpoint %s", claimed.uri)
        except (OSError, SpilloverError) as e:
            logger.warning("cannot release the claimed checkpoint %s: %s", claimed.uri, e)
