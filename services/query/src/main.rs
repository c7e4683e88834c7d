//! `tally-query` binary: see the library crate.

fn main() -> std::process::ExitCode {
    tally_shared::service::service_main("tally-query", tally_query::run)
}
