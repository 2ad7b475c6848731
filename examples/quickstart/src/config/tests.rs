//! The command line's parsing: defaults, each flag, refused values.
use super::*;

#[test]
fn flags_override_defaults_and_unknown_ones_are_refused() {
    let args = ["--epochs", "3", "--batch-size", "8", "--quiet"];
    let cfg = Config::default().parse_args(args).unwrap();
    assert_eq!((cfg.epochs, cfg.batch_size, cfg.quiet), (3, 8, true));
    assert_eq!(
        cfg.lr,
        Config::default().lr,
        "a flag not given keeps its default"
    );
    let cfg = Config::default().parse_args(["--model", "mlp-bn"]).unwrap();
    assert_eq!(cfg.model, ModelKind::MlpBn);
    let e = Config::default()
        .parse_args(["--model", "cnn"])
        .unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
    let e = Config::default().parse_args(["--bogus"]).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
    let e = Config::default().parse_args(["--lr"]).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
    let e = Config::default()
        .parse_args(["--epochs", "two"])
        .unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
}

/// Values that used to panic (a batch of 0, too few samples) or train into NaN are refused
/// where they are parsed, naming the flag.
#[test]
fn values_that_cannot_train_are_refused_at_parsing() {
    let cases: [&[&str]; 8] = [
        &["--batch-size", "0"],
        &["--epochs", "0"],
        &["--samples", "0"],
        &["--samples", "1"],
        &["--lr", "nan"],
        &["--lr", "inf"],
        &["--lr", "0"],
        &["--lr=-0.1"],
    ];
    for args in cases {
        let e = Config::default().parse_args(args).unwrap_err();
        assert_eq!(
            e.kind(),
            clap::error::ErrorKind::ValueValidation,
            "{args:?}"
        );
        let flag = args[0].split('=').next().unwrap_or_default();
        assert!(e.to_string().contains(flag), "{args:?}: {e}");
    }
    let cfg = Config::default()
        .parse_args(["--batch-size", "1", "--samples", "4", "--lr", "1e-3"])
        .unwrap();
    assert_eq!((cfg.batch_size, cfg.samples, cfg.lr), (1, 4, 1e-3));
}

#[test]
fn a_binary_keeps_its_own_defaults_and_shows_them() {
    let digits = Config {
        epochs: 30,
        digits: Some(PathBuf::from("data/digits.csv.gz")),
        ..Config::default()
    };
    let cfg = digits.clone().parse_args(["--lr", "0.5"]).unwrap();
    assert_eq!((cfg.epochs, cfg.lr), (30, 0.5));
    assert_eq!(cfg.digits, digits.digits);
    let help = digits.command().render_long_help().to_string();
    assert!(help.contains("[default: 30]"), "{help}");
    assert!(help.contains("[default: data/digits.csv.gz]"), "{help}");
    let e = digits.parse_args(["--epoch", "3"]).unwrap_err().to_string();
    assert!(e.contains("a similar argument exists: '--epochs'"), "{e}");
}
