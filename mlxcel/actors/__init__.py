"""One actor per module; each exposes `async def run(self, *, task_status)`."""
