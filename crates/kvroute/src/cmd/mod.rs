//! One module per subcommand: turn arguments into a call of the core or server.

pub mod bench;
pub mod demo;
pub mod inspect;
pub mod mocker;
pub mod serve;
