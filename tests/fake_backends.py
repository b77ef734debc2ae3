"""Source of the torch-free fake backends the plugin tests write into pytester directories
(as module ``fakebackends``; select one with ``--fp8-backend=fakebackends:Fake``). Each test
file appends its own classes, indented the same way, to :data:`BASE`."""

BASE = """
    import time
    import conformance

    class _Trivial(conformance.Backend):
        def trace_joint(self, model, args):
            raise NotImplementedError

        def run_joint(self, gm, model, args, grad_outputs):
            raise NotImplementedError

        def provenance(self, node):
            return None

        def is_backward(self, node):
            return False

    class Fake(_Trivial):
        name = "fake"
        version = "1.2"
        capabilities = frozenset({"provenance"})
"""
