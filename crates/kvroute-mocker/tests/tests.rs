//! kvroute-mocker's integration tests: one binary, real sockets on 127.0.0.1 only.

mod suite;
