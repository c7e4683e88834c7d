//! `tally-graph` binary: see the library crate.

fn main() -> std::process::ExitCode {
    tally_shared::service::service_main("tally-graph", tally_graph::run)
}
