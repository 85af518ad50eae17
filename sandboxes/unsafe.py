"""NOT A SANDBOX. The "unsafe-subprocess" backend runs commands as plain child processes of this one.

It exists only to debug tools and environments on a machine with neither Docker nor bubblewrap. It
isolates nothing: commands run as your user, see your files, your environment's network and your
processes, and can delete or read anything you can. Never point it at model-written code you have not
read. It keeps what the interface promises that does not need isolation: a private working directory,
a scrubbed environment, timeouts that kill the process tree, output caps, and cleanup on close.
"""

from __future__ import annotations

import logging
import os
import sys

from sandboxes.channel import AgentChannel
from sandboxes.local import ProcessSandbox

logger = logging.getLogger(__name__)


class UnsafeSubprocessSandbox(ProcessSandbox):
    """Plain subprocesses, no isolation (see the module docstring). `spec.workdir` is ignored: commands
    run in a fresh temporary directory."""

    async def _launch(self) -> AgentChannel:
        logger.warning(
            "sandbox %s uses the 'unsafe-subprocess' backend: commands run UNISOLATED as this user", self.name
        )
        workdir = str(self._make_dir())
        return await self._spawn(
            self.agent_command(sys.executable, workdir),
            cwd=workdir,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir},
        )
