"""What training reads: datasets, chat and SFT samples, Goldfish masks, batches and their
context-parallel shares. Preparing data offline is :mod:`megatron.apertus.prep`'s, which this
package never imports."""
