//! kvroute in front of real vLLM engines: the real `kvroute` binary as a
//! child process against the engines `scripts/real-engines start` runs
//! (vLLM on the CPU, the project's tiny model), named by
//! `KVROUTE_REAL_ENGINES=DIR/engines.json`. Without it every test fails,
//! naming the command that starts them; `scripts/test` installs vLLM,
//! starts two engines for the run and stops them after. The tests take
//! turns (they share the engines) and each starts from emptied caches.

mod real;
mod support;
