"""The contract fp8conf and its conformance suite share, torch-free and importing neither.

fp8conf (the reference passes) and ``conformance`` (the suite that judges any backend, the
reference among them) both import this package as a leaf: it imports only the standard library.
It holds

* the contract proper, which :mod:`conformance.api` re-exports unchanged for backend authors:
  the error protocol (:mod:`fp8contract.errors`), the neutral value types
  (:mod:`fp8contract.types`) and the spec registry (:mod:`fp8contract.spec`);
* two standard-library helpers both sides use: writing a file whole or not at all
  (:mod:`fp8contract.writing`) and starting rank processes from a fork server
  (:mod:`fp8contract.rank_processes`).

Backend authors keep importing :mod:`conformance.api`; the classes are the same objects under
either name.
"""
