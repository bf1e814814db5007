"""A scripted environment for multi-turn tests: it answers every model turn the same way."""

OBS = "tool said 123"


class ScriptEnv:
    """Two observations, then done with reward 1 on the third turn (whatever the model says)."""

    def reset(self, problem):
        self.n = 0
        return [{"role": "user", "content": f"question {problem}"}]

    def step(self, messages, turn):
        self.n += 1
        if self.n < 3:
            return OBS, 0.0, False, {"tool_call": 1}
        return None, 1.0, True, {"success": 1.0}
