//! kvroute's end-to-end tests, one binary: the real `kvroute` executable
//! (`serve`, `mocker`, `demo`, `bench`, `inspect`) as child processes, real
//! sockets and real HTTP on 127.0.0.1 only, and ingestion over real ZeroMQ.

mod suite;
mod support;
