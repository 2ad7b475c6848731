//! The quickstart's data: the synthetic [`MyDataset`], the bundled handwritten [`Digits`], a
//! split of either ([`Data`]), and batches of them ([`MyBatcher`]).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Input features per sample.
pub const FEATURES: usize = 16;
/// Number of classes.
pub const CLASSES: usize = 4;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn unit(seed: u64) -> f32 {
    (splitmix(seed) >> 40) as f32 / (1u64 << 24) as f32
}

/// One sample: features and class.
#[derive(Debug, Clone)]
pub struct MyItem {
    /// Input features.
    pub x: Vec<f32>,
    /// Class.
    pub y: usize,
}

/// A synthetic classification set: each class is a Gaussian-ish blob around its own centre.
/// Sample `i` is a pure function of `(split, i)`, so every process sees the same data.
#[derive(Debug, Clone)]
pub struct MyDataset {
    len: usize,
    split: u64,
    features: usize,
    classes: usize,
}

impl MyDataset {
    /// The training split.
    pub fn train(len: usize) -> Self {
        MyDataset {
            len,
            split: 1,
            features: FEATURES,
            classes: CLASSES,
        }
    }
    /// The validation split.
    pub fn valid(len: usize) -> Self {
        MyDataset {
            split: 2,
            ..Self::train(len)
        }
    }
    /// The same set with `features` inputs and `classes` classes (default [`FEATURES`] and
    /// [`CLASSES`]).
    pub fn shape(mut self, features: usize, classes: usize) -> Self {
        self.features = features;
        self.classes = classes;
        self
    }
}

impl Dataset<MyItem> for MyDataset {
    fn get(&self, index: usize) -> Result<MyItem, DatasetError> {
        let key = (self.split << 32) ^ index as u64;
        let y = (splitmix(key) % self.classes as u64) as usize;
        let mut x = vec![0f32; self.features];
        for (f, v) in x.iter_mut().enumerate() {
            let centre = unit(((y as u64) << 8) ^ f as u64 ^ 0xc0ffee) * 4.0 - 2.0;
            let noise = unit(key.wrapping_mul(31) ^ ((f as u64) << 48)) * 2.0 - 1.0;
            *v = centre + 1.5 * noise;
        }
        Ok(MyItem { x, y })
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// The UCI handwritten digits (1797 images of 8x8 pixels, CC BY 4.0; see `data/README.md`),
/// read from scikit-learn's `digits.csv.gz`. Pixels are scaled to `0..=1`.
#[derive(Debug, Clone)]
pub struct Digits {
    items: Arc<Vec<MyItem>>,
}

/// Pixels per digit image.
pub const DIGIT_PIXELS: usize = 64;

impl Digits {
    /// The copy shipped with this example.
    pub fn bundled_path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/digits.csv.gz")
    }

    /// Reads `digits.csv.gz` (64 pixel columns, then the digit).
    pub fn load(path: &std::path::Path) -> Result<Self> {
        use std::io::Read;
        let file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .with_context(|| format!("decompressing {}", path.display()))?;
        let items = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(n, line)| {
                let values: Vec<f32> = line
                    .split(',')
                    .map(|v| v.trim().parse::<f32>())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("{} line {}", path.display(), n + 1))?;
                if values.len() != DIGIT_PIXELS + 1 {
                    bail!(
                        "{} line {}: {} columns, expected 65",
                        path.display(),
                        n + 1,
                        values.len()
                    );
                }
                Ok(MyItem {
                    x: values[..DIGIT_PIXELS].iter().map(|p| p / 16.0).collect(),
                    y: values[DIGIT_PIXELS] as usize,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Digits {
            items: Arc::new(items),
        })
    }

    /// Every fifth image for validation, the rest for training.
    pub fn split(&self) -> (Data, Data) {
        let pick = |valid: bool| Data::Table {
            items: self.items.clone(),
            indices: (0..self.items.len())
                .filter(|i| (i % 5 == 0) == valid)
                .collect(),
        };
        (pick(false), pick(true))
    }
}

/// A training or validation split of either data source.
#[derive(Debug, Clone)]
pub enum Data {
    /// The synthetic [`MyDataset`].
    Synthetic(MyDataset),
    /// Rows of a table (the digits).
    Table {
        /// All rows.
        items: Arc<Vec<MyItem>>,
        /// The rows of this split.
        indices: Vec<usize>,
    },
}

impl Dataset<MyItem> for Data {
    fn get(&self, index: usize) -> Result<MyItem, DatasetError> {
        match self {
            Data::Synthetic(d) => d.get(index),
            Data::Table { items, indices } => indices
                .get(index)
                .and_then(|i| items.get(*i))
                .cloned()
                .ok_or_else(|| {
                    DatasetError::new(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("index {index} out of range"),
                    ))
                }),
        }
    }

    fn len(&self) -> usize {
        match self {
            Data::Synthetic(d) => d.len(),
            Data::Table { indices, .. } => indices.len(),
        }
    }
}

/// A batch of inputs and targets.
#[derive(Debug, Clone)]
pub struct MyBatch {
    /// `[batch, FEATURES]`.
    pub inputs: Tensor<2>,
    /// `[batch]`.
    pub targets: Tensor<1, Int>,
}

/// Stacks items into a [`MyBatch`].
#[derive(Debug, Clone, Default)]
pub struct MyBatcher;

impl Batcher<MyItem, MyBatch> for MyBatcher {
    fn batch(&self, items: Vec<MyItem>, device: &Device) -> MyBatch {
        let (n, features) = (items.len(), items.first().map_or(0, |i| i.x.len()));
        let x: Vec<f32> = items.iter().flat_map(|i| i.x.iter().copied()).collect();
        let y: Vec<i64> = items.iter().map(|i| i.y as i64).collect();
        MyBatch {
            inputs: Tensor::from_data(TensorData::new(x, [n, features]), device),
            targets: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_digits_load_and_split() {
        let digits = Digits::load(&Digits::bundled_path()).unwrap();
        let (train, valid) = digits.split();
        assert_eq!((train.len(), valid.len()), (1437, 360));
        let item = valid.get(0).unwrap();
        assert_eq!(item.x.len(), DIGIT_PIXELS);
        assert_eq!(item.y, 0, "the first image of the file is a zero");
        let classes: std::collections::BTreeSet<usize> =
            (0..train.len()).map(|i| train.get(i).unwrap().y).collect();
        assert_eq!(classes.len(), 10);
        assert!(item.x.iter().all(|p| (0.0..=1.0).contains(p)));
    }
}
