"""ResNet on ImageNet (or digits, or fake data) with quantized gradient all-reduce."""
